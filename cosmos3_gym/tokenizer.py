"""A small Qwen2 byte-level BPE tokenizer trained in-process, for models trained from scratch by this project
(``training.world_model``) and for the tiny test checkpoints (``cosmos3_gym.testing``)."""

from __future__ import annotations

# Byte-level BPE vocabulary: the 256 byte symbols, the special tokens and about 250 merges, so embedding tables stay
# small while the pipeline's action prompt is about 150 tokens.
TINY_TOKENIZER_VOCAB_SIZE = 512
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (
    PAD_TOKEN,
    "<|im_start|>",
    EOS_TOKEN,
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# The Qwen3-VL chat template without its tool-calling branches: an optional leading system turn, user/assistant
# turns whose content is a string or a list of text/image/video parts, and the assistant generation prompt.
QWEN_CHAT_TEMPLATE = """\
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content) %}
    {%- if content is string %}
        {{- content }}
    {%- else %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- set image_count.value = image_count.value + 1 %}
                {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                <|vision_start|><|image_pad|><|vision_end|>
            {%- elif 'video' in item or item.type == 'video' %}
                {%- set video_count.value = video_count.value + 1 %}
                {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                <|vision_start|><|video_pad|><|vision_end|>
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _tokenizer_training_text() -> list[str]:
    """Robot-task text in the shapes the pipeline's prompts take (action JSON caption, metadata sentences)."""
    from diffusers.pipelines.cosmos import pipeline_cosmos3_omni as omni

    tasks = [
        "pick up the red cup and place it in the bowl",
        "push the T-shaped block onto the green target",
        "open the top drawer of the cabinet",
        "close the microwave door",
        "put the banana on the plate",
        "stack the blue block on top of the yellow block",
        "move the spoon to the left of the pot",
        "wipe the table with the towel",
        "turn on the faucet and wash the mug",
        "fold the cloth in half",
        "pour water from the bottle into the glass",
        "grasp the handle and pull the door open",
        "robot picks up the marker and puts it in the box",
        "the gripper slides the cube to the right side of the table",
        "the robot arm reaches for the apple near the sink",
    ]
    viewpoints = list(omni._ACTION_VIEWPOINT_TEMPLATES.values())
    metadata = [
        omni._SYSTEM_PROMPT_VIDEO,
        omni._SYSTEM_PROMPT_IMAGE,
        "The video is 1.4 seconds long and is of 24 FPS. This video is of 480x832 resolution.",
        "The video is 2.2 seconds long and is of 15 FPS. This video is of 544x736 resolution.",
        "This image is of 256x256 resolution. 0 1 2 3 4 5 6 7 8 9 10 16 24 32 33 64 192 320 640 720 960 1280",
    ]
    captions = [
        omni.Cosmos3OmniPipeline._build_action_json_prompt(
            task, view_point=view_point, num_frames=frames, fps=fps, height=height, width=width
        )
        for task, view_point, (frames, fps, height, width) in zip(
            tasks,
            list(omni._ACTION_VIEWPOINT_TEMPLATES) * 4,
            [(17, 24.0, 480, 832), (33, 15.0, 544, 736), (5, 24.0, 256, 256), (9, 24.0, 320, 256)] * 4,
        )
    ]
    return tasks + viewpoints + metadata + captions


def build_tiny_tokenizer():
    """A Qwen2 byte-level BPE tokenizer trained in-process, with Qwen's special tokens and chat template.

    Normaliser, pre-tokenizer and decoder are Qwen2's, only the vocabulary is trained on a few hundred words, so any
    text still encodes (unknown words as bytes).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_tokenizer_training_text(), trainer)
    return Qwen2TokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        unk_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=QWEN_CHAT_TEMPLATE,
    )
