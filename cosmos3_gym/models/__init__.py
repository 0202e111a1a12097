"""Cosmos3 model components."""

from cosmos3_gym.models.light_decoder import LightDecoder, LightDecoderConfig
from cosmos3_gym.models.vae import Cosmos3VAE, TileConfig

__all__ = ["Cosmos3VAE", "LightDecoder", "LightDecoderConfig", "TileConfig"]
