"""Entry point for Qwen3-VL input processing (implemented in `common.processing`)."""

from common.processing import ProcessedPrompt, Processor, ProcessorSettings

__all__ = ["ProcessedPrompt", "Processor", "ProcessorSettings"]
