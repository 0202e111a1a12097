"""Post-training of Cosmos3 policy world models on episode datasets.

``train_vae`` trains a small Wan2.2-layout VAE on the dataset's frames; ``train_world_model`` trains a Cosmos3 policy
transformer with flow matching on windows of those frames and actions (policy / forward / inverse dynamics masks
drawn per sample) and exports a complete diffusers-layout checkpoint. The dataset layout is documented in
``cosmos3_gym.training.data``; LeRobot v3.0 / v2.1 datasets (``"lerobot:PATH"``) are read by
``cosmos3_gym.data.lerobot``. Large models train sharded over GPUs (FSDP2, ``training.fsdp``) or with LoRA
adapters (``training.lora``). ``train_light_decoder`` distils a cheap ``LightDecoder`` for a VAE's latent space.
"""

from .export import export_checkpoint, native_to_diffusers_state_dict
from .light_decoder import LightDecoderTrainConfig, build_decoder_windows, train_light_decoder
from .vae import VAETrainConfig, train_vae
from .world_model import DEFAULT_MODEL_CONFIG, WorldModelTrainConfig, WorldModelTrainer, train_world_model

__all__ = [
    "DEFAULT_MODEL_CONFIG",
    "LightDecoderTrainConfig",
    "VAETrainConfig",
    "WorldModelTrainConfig",
    "WorldModelTrainer",
    "build_decoder_windows",
    "export_checkpoint",
    "native_to_diffusers_state_dict",
    "train_light_decoder",
    "train_vae",
    "train_world_model",
]
