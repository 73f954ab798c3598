"""What a store was made from. A trainer or a resumed job states what it expects;
any difference is refused with the field that differs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields

from .layout import LAYER_ID_CONVENTION


class FingerprintMismatch(ValueError):
    def __init__(self, differences: dict):
        self.differences = differences
        lines = [f"{name}: store has {have!r}, expected {want!r}" for name, (have, want) in differences.items()]
        super().__init__("store fingerprint does not match: " + "; ".join(lines))


@dataclass(frozen=True)
class Fingerprint:
    target_model: str  # path or hub name the target was loaded from
    num_target_layers: int
    hidden_size: int
    vocab_size: int
    layer_ids: tuple[int, ...]
    max_length: int
    layer_id_convention: str = LAYER_ID_CONVENTION
    dtype: str = "bfloat16"
    target_revision: str = ""
    target_config_sha256: str = ""
    target_weights_index_sha256: str = ""
    tokenizer_sha256: str = ""
    chat_template_sha256: str = ""
    corpus_sha256: str = ""
    kernels: dict = field(default_factory=dict)  # e.g. {"linear_attention": "torch"}
    package_versions: dict = field(default_factory=dict)
    target_topk: int = 0

    def __post_init__(self):
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))
        if not self.layer_ids:
            raise ValueError("fingerprint needs at least one layer id")
        bad = [i for i in self.layer_ids if not 0 <= i <= self.num_target_layers - 2]
        if bad:
            raise ValueError(
                f"layer ids {bad} outside 0..{self.num_target_layers - 2}: id L is the output of decoder "
                f"layer L, and the final layer ({self.num_target_layers - 1}) is never a context layer"
            )
        if list(self.layer_ids) != sorted(set(self.layer_ids)):
            raise ValueError(f"layer ids must be sorted and unique, got {list(self.layer_ids)}")

    def to_json(self) -> dict:
        data = asdict(self)
        data["layer_ids"] = list(self.layer_ids)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Fingerprint":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    def check(self, **expected) -> None:
        """Raise FingerprintMismatch naming every field whose value differs."""
        differences = {}
        for name, want in expected.items():
            if not hasattr(self, name):
                raise KeyError(f"fingerprint has no field {name!r}")
            have = getattr(self, name)
            if isinstance(have, tuple):
                want = tuple(want)
            if have != want:
                differences[name] = (have, want)
        if differences:
            raise FingerprintMismatch(differences)


def package_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("torch", "transformers", "zarr", "numcodecs", "ray", "flash-linear-attention", "causal-conv1d"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            continue
    return versions


def file_sha256(*paths) -> str:
    """Hash of the given files' bytes, in order; missing files hash as empty."""
    digest = hashlib.sha256()
    for path in paths:
        try:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        except FileNotFoundError:
            digest.update(b"<missing>")
    return digest.hexdigest()
