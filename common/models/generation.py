"""Generation defaults from a checkpoint's `generation_config.json`.

What is read: `do_sample`, `temperature`, `top_p`, `top_k`, `max_new_tokens` and
`eos_token_id` (an int or a list). As in `transformers`' `generate`, `do_sample: false` (or
absent) means greedy whatever the temperature says, and `do_sample: true` without a
temperature (absent or null) samples at 1.0; `top_p` / `top_k` are kept either way (greedy
ignores them; a request that sets a temperature samples with them).
`max_new_tokens` is the default `max_tokens` of a request that leaves it unset; without it
the default is `SamplingParams`' own. `eos_token_id` here wins over `config.json`'s (it is what the
reference's `generate` stops on): `Qwen3VLConfig.from_file` of a folder applies it.
Other keys are ignored (they steer the reference's search, not what epd implements).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.sampling import SamplingParams

GENERATION_FILE = "generation_config.json"


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """A checkpoint's default sampling; None fields fall back to `SamplingParams`' own."""

    temperature: float | None = None  # 0.0: do_sample false; 1.0: do_sample, no temperature
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None  # the default max_tokens
    eos_token_ids: tuple[int, ...] = ()  # empty: use config.json's

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GenerationDefaults:
        """Read the `generation_config.json` form (see the module docstring)."""
        temperature = 0.0  # greedy
        if raw.get("do_sample", False):  # transformers samples at 1.0 when none is given
            temperature = 1.0 if raw.get("temperature") is None else float(raw["temperature"])
        eos = raw.get("eos_token_id")
        eos_ids = (
            () if eos is None else tuple(int(e) for e in ([eos] if isinstance(eos, int) else eos))
        )
        top_k = raw.get("top_k")
        return cls(
            temperature=temperature,
            top_p=float(raw["top_p"]) if raw.get("top_p") is not None else None,
            top_k=int(top_k) if top_k is not None else None,
            max_new_tokens=(
                int(raw["max_new_tokens"]) if raw.get("max_new_tokens") is not None else None
            ),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> GenerationDefaults:
        """The folder's `generation_config.json`, or no defaults when it has none."""
        path = Path(folder) / GENERATION_FILE
        if not path.is_file():
            return cls()
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"{GENERATION_FILE} must hold a JSON object")
        return cls.from_dict(raw)

    def sampling(self, **overrides: Any) -> SamplingParams:
        """`SamplingParams` with these defaults, then `overrides` (a request's own values;
        a None override leaves the default in place)."""
        values: dict[str, Any] = {}
        if self.temperature is not None:
            values["temperature"] = self.temperature
        if self.top_p is not None:
            values["top_p"] = self.top_p
        if self.top_k is not None:
            values["top_k"] = self.top_k
        if self.max_new_tokens is not None:
            values["max_tokens"] = self.max_new_tokens
        values.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**values)
