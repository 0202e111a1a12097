"""Checked doc lines (issue 41): what the README's and the docs' code shows must not teach a mistake."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VIDEO_WRITERS = ("write_video", "save_video")  # cosmos3_gym.media's, gymnasium.utils.save_video's


def python_blocks(markdown: str) -> list[str]:
    """The Python code of every ```python block (indented blocks, as in admonitions, dedented) and of every
    ``python - <<'EOF'`` here-document in a shell block (the README's first-hour snippet was one)."""
    blocks = []
    fence = r"^([ \t]*)```(python|py|bash|sh|shell|console)[^\n]*\n(.*?)^\1```"
    for match in re.finditer(fence, markdown, re.DOTALL | re.MULTILINE):
        indent, language = match.group(1), match.group(2)
        code = "".join(line[len(indent):] for line in match.group(3).splitlines(keepends=True))
        if language in ("python", "py"):
            blocks.append(code)
        else:
            heredocs = r"python[\d.]* -[^\n]*<<-?\s*['\"]?(\w+)['\"]?[^\n]*\n(.*?)^\1$"
            blocks += [body for _, body in re.findall(heredocs, code, re.DOTALL | re.MULTILINE)]
    return blocks


def videos_written_at_render_fps(code: str) -> list[str]:
    """The calls of a video writer that take their frame rate from ``render_fps``: one frame per env STEP, while a
    step generates ``chunk`` frames, so a video of every frame written at it plays ``chunk`` times slow."""
    try:
        tree = ast.parse(code)
    except SyntaxError:  # a fragment: the plain text decides
        return re.findall(rf"(?:{'|'.join(VIDEO_WRITERS)})\([^)]*render_fps", code, re.DOTALL)
    # names given render_fps first (fps = env.metadata["render_fps"]) count as render_fps
    aliases = {"render_fps"} | {
        target.id
        for node in ast.walk(tree) if isinstance(node, ast.Assign) and "render_fps" in ast.unparse(node.value)
        for target in node.targets if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            arguments = [*node.args[1:], *(keyword.value for keyword in node.keywords)]
            named = {n.id for argument in arguments for n in ast.walk(argument) if isinstance(n, ast.Name)}
            if name in VIDEO_WRITERS and ("render_fps" in ast.unparse(node) or named & aliases):
                found.append(ast.unparse(node))
    return found


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_checker_finds_a_video_written_at_render_fps():
    """The README's snippet before issue 41, and variants of it."""
    assert videos_written_at_render_fps(
        'write_video("runs/first_steps.mp4", np.stack(frames), fps=env.metadata["render_fps"])'
    )
    assert videos_written_at_render_fps("fps = env.metadata['render_fps']\nmedia.write_video(p, f, fps=fps)")
    assert videos_written_at_render_fps("save_video(frames, 'videos', fps=env.metadata['render_fps'])")
    assert videos_written_at_render_fps("write_video(p, frames, fps=env.metadata['render_fps'] ...")  # a fragment
    assert not videos_written_at_render_fps("write_video(p, frames, fps=env.unwrapped.settings.fps)")
    block = "```python\nwrite_video(p, f, fps=env.metadata['render_fps'])\n```\n\n    ```python\n    x = 1\n    ```\n"
    assert python_blocks(block) == ["write_video(p, f, fps=env.metadata['render_fps'])\n", "x = 1\n"]
    shell = ("```bash\npip install .\npython - <<'EOF'\nimport numpy\n"
             "write_video(p, f, fps=e.metadata['render_fps'])\nEOF\n```")
    assert [videos_written_at_render_fps(code) for code in python_blocks(shell)] == [
        ["write_video(p, f, fps=e.metadata['render_fps'])"]
    ]


def test_the_readme_has_python_code_that_parses():
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert blocks, "the README shows no python code"
    for block in blocks:
        ast.parse(block)  # the first episode's snippet is meant to be copied and run


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_no_snippet_writes_every_frame_at_render_fps(path):
    """Issue 41: the README wrote every frame of a chunk at render_fps (1.25 fps for PushT), so its video played 8x
    slow. Frames are written at ``env.unwrapped.settings.fps``; render_fps is for one frame per step."""
    written = [call for block in python_blocks(path.read_text()) for call in videos_written_at_render_fps(block)]
    assert written == [], f"{path.name}: {written}"


def docs_text() -> str:
    return "\n".join(path.read_text() for path in markdown_files())


def test_the_cpu_docs_say_how_to_set_threads():
    """Issue 41: two torch processes on 2 cores made a 4-env step take 15 s instead of 0.7 s."""
    cpu = (ROOT / "docs" / "tutorials" / "cpu.md").read_text()
    assert "torch.set_num_threads" in cpu and "OMP_NUM_THREADS=1" in cpu
    assert re.search(r'gym\.make\("cosmos3_gym/[\w-]+", num_threads=\d\)', cpu)  # the env's own argument


def test_the_docs_show_how_to_build_what_sb3vecenv_needs():
    """Issue 41: the README never showed it; gymnasium's own spelling, vector_kwargs, works (test_vector_env.py)."""
    text = docs_text()
    assert "SB3VecEnv(gym.make_vec(" in text and 'vector_kwargs=' in text and "AutoresetMode.SAME_STEP" in text


def test_the_docs_name_the_video_extra_where_recordvideo_names_gymnasiums():
    """Issue 41: RecordVideo's error says `pip install "gymnasium[other]"`; the docs name this package's [video]
    extra, say what it does to pillow, and how to write videos without moviepy."""
    paragraphs = docs_text().split("\n\n")
    assert [p for p in paragraphs if "gymnasium[other]" in p and "[video]" in p and "pillow" in p], \
        "no paragraph names RecordVideo's gymnasium[other], the [video] extra and its pillow pin together"
    assert "write_video(" in docs_text()
