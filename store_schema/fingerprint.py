"""What a store was made from. A trainer or a resumed job states what it expects;
any difference is refused with the field that differs."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .dtypes import store_dtype
from .layout import LAYER_ID_CONVENTION, validate_layer_ids
from .plan import Plan, PlanSettings
from .provenance import PROVENANCES, UNKNOWN
from .runtime.weights_digest import weights_sha256


class FingerprintMismatch(ValueError):
    def __init__(self, differences: dict, subject: str = "store"):
        self.differences = differences
        super().__init__(f"{subject} fingerprint does not match: " + describe_differences(differences, subject))


def describe_differences(differences: Mapping, subject: str = "store") -> str:
    """``field: <subject> has X, expected Y; ...``: the one wording of what differs
    (a store's fingerprint, a generated corpus's generation settings)."""
    return "; ".join(f"{name}: {subject} has {have!r}, expected {want!r}" for name, (have, want) in differences.items())


def mapping_differences(have: Mapping, want: Mapping, ignore: Iterable[str] = ()) -> dict:
    """{field: (have, want)} for every field of `want` whose value differs from `have`'s.
    A field `have` never recorded (`RECORDED_LATER`: older stores and corpora lack it)
    is not compared: nothing says it differs."""
    skip = set(ignore) | {name for name in RECORDED_LATER if not have.get(name)}
    return {name: (have.get(name), want[name]) for name in want if name not in skip and have.get(name) != want[name]}


# Identity fields a store or generated corpus made before them does not record ("").
RECORDED_LATER = ("target_weights_sample_sha256", "target_weights_sha256", "target_config")
# What says which checkpoint a target directory is, as far as a reader can check
# without loading it: its config and its weights (`target_identity`).
TARGET_CHECKS = ("target_config_sha256", "target_weights_index_sha256", "target_weights_sample_sha256")
FULL_WEIGHTS_CHECK = "target_weights_sha256"  # every byte: read on request (--full-weights-check)


@dataclass(frozen=True)
class TargetFacts:
    """What a store records of the target besides its identity: its size and the
    kernels that computed the states, as the job's workers loaded it (or, with
    nothing left to compute, as its config and the store say)."""

    num_target_layers: int
    hidden_size: int
    vocab_size: int
    kernels: dict = field(default_factory=dict)  # e.g. {"linear_attention": "torch", "compute_dtype": "float32"}


# Fields added after schema version 1, with the value every older store implicitly has:
# left out of the stored JSON at that value, so older stores keep their fingerprint hash.
_ADDED_LATER = {
    "loss_mask": "content",
    "projection": {},
    "response_provenance": UNKNOWN,
    "response_sampling": {},
    "target_config": {},
    "target_weights_sample_sha256": "",
    "target_weights_sha256": "",
}


@dataclass(frozen=True)
class Fingerprint:
    target_model: str  # path or hub name the target was loaded from
    num_target_layers: int
    hidden_size: int
    vocab_size: int
    layer_ids: tuple[int, ...]
    max_length: int
    layer_id_convention: str = LAYER_ID_CONVENTION
    dtype: str = "bfloat16"  # the store dtype of hidden states: bfloat16, fp8_e4m3 or fp4_e2m1 (store_schema.dtypes)
    target_revision: str = ""
    target_config_sha256: str = ""
    target_config: dict = field(default_factory=dict)  # its config.json: a differing target is told by field
    target_weights_index_sha256: str = ""
    target_weights_sample_sha256: str = ""  # `weights_sample_sha256`: tells same-shaped weights apart
    target_weights_sha256: str = ""  # `runtime.weights_digest`: every byte, for --full-weights-check
    tokenizer_sha256: str = ""
    chat_template_sha256: str = ""
    corpus_sha256: str = ""
    kernels: dict = field(default_factory=dict)  # e.g. {"linear_attention": "torch"}
    package_versions: dict = field(default_factory=dict)
    target_topk: int = 0
    loss_mask: str = "content"  # the plan's loss-mask scope (PlanSettings.loss_mask); stores before it: content
    # Where the responses came from: target / other / unknown (`store_schema.provenance`).
    response_provenance: str = UNKNOWN
    # How the responses were decoded when the target generated them (`provenance.response_sampling`).
    response_sampling: dict = field(default_factory=dict)
    # A projected store's `projection.Projection.summary()` (ranks, energy kept, the file's sha256); {}: none.
    projection: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.response_provenance not in PROVENANCES:
            raise ValueError(f"response_provenance must be one of {PROVENANCES}, got {self.response_provenance!r}")
        ids = validate_layer_ids([int(i) for i in self.layer_ids], self.num_target_layers)
        object.__setattr__(self, "layer_ids", tuple(ids))
        object.__setattr__(self, "dtype", store_dtype(self.dtype).name)

    @classmethod
    def for_extraction(
        cls,
        identity: Mapping,
        plan: Plan,
        layer_ids: Iterable[int],
        target: "TargetFacts",
        *,
        target_topk: int = 0,
        dtype: str = "bfloat16",
        response_provenance: str = UNKNOWN,
        response_sampling: Mapping | None = None,
        projection: Mapping | None = None,
    ) -> "Fingerprint":
        """The fingerprint of a store extracted along `plan` from the target that
        `identity` names (`target_identity`, hashed once by the job), its size and
        kernels as the workers loaded it (`target`), the plan's max length and the
        tokenizer, chat-template and corpus hashes the plan recorded, where the corpus's
        responses came from (`store_schema.provenance`), and this environment's
        package versions."""
        recorded = plan.settings
        settings = PlanSettings.from_json(recorded)
        return cls(
            **identity,
            num_target_layers=int(target.num_target_layers),
            hidden_size=int(target.hidden_size),
            vocab_size=int(target.vocab_size),
            layer_ids=tuple(layer_ids),
            max_length=settings.max_length,
            tokenizer_sha256=recorded.get("tokenizer_hash") or "",
            chat_template_sha256=recorded.get("chat_template_hash") or "",
            corpus_sha256=recorded.get("corpus_hash") or "",
            kernels=dict(target.kernels),
            package_versions=package_versions(),
            target_topk=int(target_topk),
            dtype=dtype,
            loss_mask=settings.loss_mask,
            response_provenance=response_provenance,
            response_sampling=dict(response_sampling or {}),
            target_config=read_config_json(identity["target_model"]),
            projection=dict(projection or {}),
        )

    def layer_width(self, layer_id: int) -> int:
        """Values a token the store keeps of layer `layer_id`: its projection's rank, or the hidden size."""
        ranks = self.projection.get("ranks", {})
        return int(ranks.get(str(layer_id), self.hidden_size))

    def to_json(self) -> dict:
        """The fields as stored; a field added later is left out while it holds what
        every store before it meant, so those stores keep their recorded hash."""
        data = self.values()
        for name, before in _ADDED_LATER.items():
            if data[name] == before:
                del data[name]
        return data

    def values(self) -> dict:
        """Every field, JSON-shaped."""
        data = asdict(self)
        data["layer_ids"] = list(self.layer_ids)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Fingerprint":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def sha256(self) -> str:
        return self._sha256

    @cached_property
    def _sha256(self) -> str:  # computed once: every shard's check compares against it
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    def diff(self, expected: "Fingerprint | Mapping", ignore: Iterable[str] = ()) -> dict:
        """{field: (store's value, expected value)} for every field that differs.

        expected: another Fingerprint (every field compared: a resumed job) or a
        mapping of the fields a reader cares about (a trainer: hidden size, vocabulary,
        layer count). `ignore` names fields that may differ."""
        have = self.values()
        if isinstance(expected, Fingerprint):
            want = expected.values()
        else:
            unknown = sorted(set(expected) - set(have))
            if unknown:
                raise KeyError(f"fingerprint has no field(s) {unknown}")
            want = {name: list(value) if isinstance(value, tuple) else value for name, value in expected.items()}
        return mapping_differences(have, want, ignore)

    def check(self, expected: "Fingerprint | Mapping | None" = None, *, ignore: Iterable[str] = (), **fields) -> None:
        """Raise FingerprintMismatch naming every field that differs from `expected`
        (a Fingerprint or a mapping), or from the keyword `fields`."""
        if (expected is None) == (not fields):
            raise TypeError("check() takes either an expected fingerprint/mapping or keyword fields")
        differences = self.diff(expected if expected is not None else fields, ignore)
        if differences:
            raise FingerprintMismatch(differences)

    def target_differences(self, model_path: str | Path, full: bool = False) -> dict:
        """{field: (store's value, the directory's)} for each `TARGET_CHECKS` field this
        store recorded that differs for the target at `model_path`: is it the
        checkpoint the store was extracted from (config, weights' headers and sampled
        bytes; with `full`, every byte: `FULL_WEIGHTS_CHECK`). A field the store left
        empty is not known, so not compared."""
        have = self.values()
        identity = target_identity(model_path, full=full)
        checks = (*TARGET_CHECKS, FULL_WEIGHTS_CHECK) if full else TARGET_CHECKS
        want = {name: identity[name] for name in checks if have.get(name)}
        return mapping_differences(have, want)


def package_versions() -> dict:
    versions = {}
    for name in ("torch", "transformers", "zarr", "numcodecs", "ray", "flash-linear-attention", "causal-conv1d"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            continue
    return versions


def weights_index_sha256(model_path: str | Path) -> str:
    """Hash of the weights' index: ``model.safetensors.index.json`` when sharded,
    else every safetensors file's name, size and header (tensor names, dtypes,
    shapes, offsets) -- cheap, and it changes whenever the weights' layout does."""
    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return hashlib.sha256(index.read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for file in sorted(path.glob("*.safetensors")):
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(size, 1 << 28)))
    return digest.hexdigest()


SAMPLE_WINDOWS = 16  # byte windows hashed per weight file
SAMPLE_BYTES = 1 << 16


def weights_sample_sha256(model_path: str | Path) -> str:
    """Hash of `SAMPLE_WINDOWS` windows of `SAMPLE_BYTES` spread evenly over each
    safetensors file's tensor data (1 MiB a file, a few milliseconds at 27B).
    The index hash cannot tell two checkpoints of one shape apart (a fine-tune, a
    re-initialised copy): their headers are byte-identical; their weights are not."""
    digest = hashlib.sha256()
    for file in sorted(Path(model_path).glob("*.safetensors")):
        size = file.stat().st_size
        with open(file, "rb") as f:
            start = 8 + int.from_bytes(f.read(8), "little")
            span = max(0, size - start - SAMPLE_BYTES)
            digest.update(f"{file.name}\0{size}\0".encode())
            for k in range(SAMPLE_WINDOWS):
                f.seek(start + span * k // max(1, SAMPLE_WINDOWS - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def model_revision(model_path: str | Path) -> str:
    """The hub commit of a snapshot directory (``.../snapshots/<sha>``), if it is one."""
    resolved = Path(model_path).resolve()
    name = resolved.name
    return name if resolved.parent.name == "snapshots" and len(name) == 40 else ""


def target_identity(model_path: str | Path, full: bool = True) -> dict:
    """The fingerprint fields that say which checkpoint a target is: its resolved
    path, hub revision, and hashes of its config, weights' index and sampled weight
    bytes; with `full`, the digest of every weight byte (cached per host)."""
    path = Path(model_path)
    full_digest = {FULL_WEIGHTS_CHECK: weights_sha256(path)} if full else {}
    return {
        **full_digest,
        "target_model": str(path.resolve()),
        "target_revision": model_revision(path),
        "target_config_sha256": file_sha256(path / "config.json"),
        "target_weights_index_sha256": weights_index_sha256(path),
        "target_weights_sample_sha256": weights_sample_sha256(path),
    }


def read_config_json(model_path: str | Path) -> dict:
    """A target directory's config.json, parsed ({} when it cannot be read)."""
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def config_field_differences(recorded: Mapping, model_path: str | Path) -> list[str]:
    """'field: recorded -> found' for each config.json field (nested ones dotted) that
    differs between the recorded config and the one at `model_path`."""

    def flat(data: Mapping, prefix: str = "") -> dict:
        out: dict = {}
        for key, value in data.items():
            if isinstance(value, Mapping):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    have, found = flat(recorded), flat(read_config_json(model_path))
    return [
        f"{k}: {have.get(k)!r} -> {found.get(k)!r}"
        for k in sorted(set(have) | set(found))
        if have.get(k) != found.get(k)
    ]


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
