"""Multimodal data contracts: item metadata, params with exact runs, and their validation.

The public names live here; `params` defines them and `validation` checks the wire form.
"""

from common.multimodal.params import MultimodalItemMetadata, MultimodalParams, runs_from_mask

__all__ = ["MultimodalItemMetadata", "MultimodalParams", "runs_from_mask"]
