"""Qwen3-VL input processing: chat template, image and video preprocessing, item layout."""
