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
The values read are checked at load, as `SamplingParams` would check them: a file that
would make every request fail is refused at start, naming the file and the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.models.checkpoint_files import JsonObject, read_checkpoint_object, warn_once
from common.sampling import SamplingError, SamplingParams

GENERATION_FILE = "generation_config.json"
# Keys transformers writes that change no answer (ids of tokens epd never generates).
# Keys whose value here is what epd does without them (the released files carry some).
_NEUTRAL = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "num_beams": 1,
    "length_penalty": 1.0,
}
_BOOKKEEPING = frozenset(
    (
        "bos_token_id",
        "pad_token_id",
        "transformers_version",
        "_from_model_config",
        # transformers 5 writes these into a fine-tune's file; none changes an answer
        "use_cache",
        "output_attentions",
        "output_hidden_states",
    )
)


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """A checkpoint's default sampling; None fields fall back to `SamplingParams`' own."""

    temperature: float | None = None  # 0.0: do_sample false; 1.0: do_sample, no temperature
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None  # the default max_tokens
    eos_token_ids: tuple[int, ...] = ()  # empty: use config.json's

    @classmethod
    def from_dict(cls, raw: object, *, file: str = GENERATION_FILE) -> GenerationDefaults:
        """Read the `generation_config.json` form (see the module docstring). Raises
        `CheckpointError` naming the file and the key for a value of the wrong JSON type or
        one `SamplingParams` refuses (checked here, at load, not on every request)."""
        g = JsonObject(raw, file)
        temperature = 0.0  # greedy
        given = g.number("temperature", 1.0, positive=False)
        if g.boolean("do_sample", False):  # transformers samples at 1.0 when none is given
            temperature = given
        top_p = g.number("top_p", 1.0) if g.present("top_p") else None
        top_k = g.integer("top_k", minimum=0) if g.present("top_k") else None
        max_new = g.integer("max_new_tokens", minimum=1) if g.present("max_new_tokens") else None
        defaults = cls(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new,
            eos_token_ids=g.integers("eos_token_id", (), minimum=0),
        )
        try:
            defaults.sampling()
        except SamplingError as exc:
            key = {"max_tokens": "max_new_tokens"}.get(exc.field, exc.field)
            raise g.error(key, f"is refused: {exc}") from None
        for key in g.unread(_BOOKKEEPING):  # e.g. repetition_penalty: answers differ from HF's
            if key in _NEUTRAL and raw[key] == _NEUTRAL[key]:  # type: ignore[index]
                continue  # what epd does anyway
            warn_once(file, key, "is not understood by epd and is ignored")
        return defaults

    @classmethod
    def from_folder(cls, folder: str | Path) -> GenerationDefaults:
        """The folder's `generation_config.json`, or no defaults when it has none."""
        path = Path(folder) / GENERATION_FILE
        raw = read_checkpoint_object(path)
        return cls() if raw is None else cls.from_dict(raw, file=str(path))

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
