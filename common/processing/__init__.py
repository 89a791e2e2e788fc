"""Qwen3-VL input processing: chat template, image and video preprocessing, item layout."""

from common.processing.processor import ProcessedPrompt, Processor
from common.processing.settings import ProcessorSettings

__all__ = ["ProcessedPrompt", "Processor", "ProcessorSettings"]
