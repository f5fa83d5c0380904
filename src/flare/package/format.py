"""The package format: a metadata-only primary carrying the signed manifest, plus payload files.

Directory form:  <entry>/model.safetensors (primary, no tensors) and one file per payload, named by the
                 payload's semantic name (weights/layer-000.safetensors, frontend.safetensors, ...).
Packed form:     one safetensors file; its `__metadata__` is the primary's, and each payload's exact
                 bytes form one U8 tensor named `payload:<name>` (padding tensors keep every payload
                 64-byte aligned, so tensors read from it in place are aligned too).

The signed body is the manifest's exact JSON text; converting between forms copies it unchanged.
Physical locations are not signed: they follow from the form, and the manifest's sizes and hashes
bind every payload's bytes.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path

from flare.errors import PreparationError
from flare.package import safetensors_io as st
from flare.package.manifest import FORMAT_VERSION, PRIMARY_NAME, Manifest, ManifestError, PayloadRecord

FRONTEND_PAYLOAD = "frontend.safetensors"
# A rank's module-global payload (deployments/<name>/rank-<n>/graphs.safetensors) holds the graph catalog
# as metadata and, when prepared on a GPU, torch.compile's cache artifacts as one byte tensor with the
# environment they were made in (flare.engine.compile_cache).
GRAPH_CATALOG_METADATA = "flare.graph_catalog"
COMPILE_KEY_METADATA = "flare.compile_key"
COMPILED_ARTIFACTS_TENSOR = "torch_compile_artifacts"
TRITON_KERNELS_TENSOR = "triton_kernels"          # a gzip tar of Triton cache entries of Flare's own kernels
FLASHINFER_KERNELS_TENSOR = "flashinfer_kernels"  # a gzip tar of FlashInfer's JIT builds (flare.kernels.flashinfer_builds)
PACKED_PREFIX = "payload:"
PADDING_PREFIX = "padding:"
PACKED_ALIGNMENT = 64

KEY_FORMAT = "flare.format"
KEY_MANIFEST = "flare.manifest"
KEY_SIGNATURE = "flare.signature"
KEY_PROFILE = "flare.publisher_profile"
KEY_FORM = "flare.form"
FORMS = ("directory", "packed")

# Assets the tokenizer and chat template need at serving time, copied from the checkpoint.
FRONTEND_ASSET_NAMES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json",
                        "special_tokens_map.json", "chat_template.json", "tokenizer.model")
FRONTEND_ASSET_SUFFIXES = (".jinja",)


@dataclass(frozen=True)
class Primary:
    """What a primary's metadata holds. `manifest_body` is the signed text, kept byte for byte;
    `manifest` is that text decoded (a malformed one is refused when the Primary is made)."""

    manifest_body: str
    signature: bytes
    profile_json: str                 # the embedded public profile of the signer
    form: str                         # "directory" or "packed"
    manifest: Manifest = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "manifest", Manifest.from_json(self.manifest_body))

    def metadata(self, form: str | None = None) -> dict[str, str]:
        return {KEY_FORMAT: str(FORMAT_VERSION), KEY_FORM: form or self.form, KEY_MANIFEST: self.manifest_body,
                KEY_SIGNATURE: base64.b64encode(self.signature).decode(), KEY_PROFILE: self.profile_json}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str], where: str) -> "Primary":
        version = metadata.get(KEY_FORMAT)
        if version is None or KEY_MANIFEST not in metadata:
            raise PreparationError(f"{where} is not a Flare package: its metadata has no signed manifest")
        if version != str(FORMAT_VERSION):
            raise PreparationError(f"{where} has package format {version}; this Flare reads format "
                                   f"{FORMAT_VERSION}; export it again with `ignition export`")
        try:
            signature = base64.b64decode(metadata.get(KEY_SIGNATURE, ""), validate=True)
        except ValueError as error:
            raise PreparationError(f"{where}: the signature is corrupt ({error})") from None
        try:
            return cls(metadata[KEY_MANIFEST], signature, metadata.get(KEY_PROFILE, ""),
                       metadata.get(KEY_FORM, "directory"))
        except ManifestError as error:
            raise ManifestError(f"{where}: {error}") from None


@dataclass(frozen=True)
class PayloadLocation:
    """Where one payload's bytes are: a file, an offset inside it, and the length."""

    path: Path
    offset: int
    size: int


@dataclass(frozen=True)
class PackageFiles:
    """A package on disk, in either form: its primary record and where each payload lives."""

    primary_path: Path
    primary: Primary
    form: str
    packed_locations: dict[str, PayloadLocation]

    @property
    def manifest(self) -> Manifest:
        return self.primary.manifest

    def locate(self, record: PayloadRecord) -> PayloadLocation:
        """Where `record`'s bytes are (its name is a plain relative path: the manifest's schema says so)."""
        if self.form == "packed":
            if record.name not in self.packed_locations:
                raise PreparationError(f"payload {record.name} is missing from packed package {self.primary_path}")
            return self.packed_locations[record.name]
        return PayloadLocation(self.primary_path.parent / record.name, 0, record.size)


def write_primary(path: Path, primary: Primary) -> None:
    st.write(path, [], primary.metadata("directory"))


def read_package_files(target: Path) -> PackageFiles:
    """Open the primary of an entry directory, a primary file, or a packed file; read metadata only."""
    target = Path(target)
    primary_path = target / PRIMARY_NAME if target.is_dir() else target
    try:
        with open(primary_path, "rb") as handle:
            size = primary_path.stat().st_size
            header = st.read_header(handle, 0, size, what=str(primary_path))
    except FileNotFoundError:
        raise PreparationError(f"no package at {target}: {primary_path} does not exist") from None
    primary = Primary.from_metadata(header.metadata, str(primary_path))
    locations = {}
    for entry in header.tensors:
        if entry.name.startswith(PACKED_PREFIX):
            name = entry.name[len(PACKED_PREFIX):]
            locations[name] = PayloadLocation(primary_path, entry.start, entry.end - entry.start)
    check_form(primary.form, header, primary_path)
    if primary.form == "packed" and header.total_size > size:
        raise PreparationError(f"{primary_path} is truncated: {size} bytes of {header.total_size}")
    return PackageFiles(primary_path, primary, primary.form, locations)


def check_form(form: str, header: st.Header, where: Path) -> None:
    """`flare.form` is not signed, so it is bound to the file it describes: a directory-form primary holds
    no tensors, a packed file holds its payloads (and padding) as tensors and nothing else. Where the
    payloads are read from therefore follows from the file, never from the unsigned label alone."""
    if form not in FORMS:
        raise PreparationError(f"{where}: {KEY_FORM} is {form!r}, not one of {', '.join(FORMS)}; the package is "
                               "malformed — export or download it again")
    names = [entry.name for entry in header.tensors]
    packed = bool(names) and all(name.startswith((PACKED_PREFIX, PADDING_PREFIX)) for name in names)
    if (form == "packed") != packed or (form == "directory" and names):
        holds = f"holds {len(names)} tensors" if names else "holds no payloads"
        raise PreparationError(f"{where}: {KEY_FORM} says {form!r}, but the file {holds}; the package is "
                               "malformed — export or download it again")


def frontend_asset_names(checkpoint_dir: Path) -> list[str]:
    """The frontend files a checkpoint has, sorted so the frontend payload's bytes are reproducible."""
    names = [path.name for path in Path(checkpoint_dir).iterdir() if path.is_file() and
             (path.name in FRONTEND_ASSET_NAMES or path.name.endswith(FRONTEND_ASSET_SUFFIXES))]
    return sorted(names)
