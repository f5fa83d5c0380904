"""The manifest's schema: packages written before it round-trip byte for byte, and a malformed field is
refused when the package is opened, with a message naming it."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from flare.cli.flare import main
from flare.package import format as fmt
from flare.package import safetensors_io as st
from flare.package.manifest import Manifest, ManifestError, canonical_text
from flare.package.reader import open_package
from flare.package.signing import config_dir_for, development_identity

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "manifests"


@pytest.mark.parametrize("name", ["format2-development.json", "format2-promoted.json"])
def test_manifests_written_before_the_schema_round_trip_byte_for_byte(name):
    """Their signatures cover this exact text, so they still verify."""
    text = (FIXTURES / name).read_text()
    manifest = Manifest.from_json(text)
    assert manifest.to_json() == text
    assert manifest.plan.page_size == 16 and manifest.sampling.ranges["temperature"] == (0.0, 2.0)
    assert (manifest.promoted_from is not None) == (name == "format2-promoted.json")


def test_a_new_export_signs_the_canonical_text_of_its_manifest(export):
    files = fmt.read_package_files(export())
    assert files.manifest.to_json() == files.primary.manifest_body
    assert canonical_text(json.loads(files.primary.manifest_body)) == files.primary.manifest_body


def _resign(entry: Path, change) -> None:
    """Rewrite the entry's manifest through `change(dict)` and sign it validly with the development key,
    so only the schema stands between it and the reader."""
    files = fmt.read_package_files(entry)
    fields = json.loads(files.primary.manifest_body)
    change(fields)
    body = canonical_text(fields)
    identity = development_identity(config_dir_for(None))
    primary = entry / fmt.PRIMARY_NAME
    primary.chmod(0o644)
    primary.unlink()
    st.write(primary, [], {fmt.KEY_FORMAT: "2", fmt.KEY_FORM: "directory", fmt.KEY_MANIFEST: body,
                           fmt.KEY_SIGNATURE: base64.b64encode(identity.sign(body.encode())).decode(),
                           fmt.KEY_PROFILE: identity.profile.to_json()})


def _rename(fields: dict, section: str, old: str, new: str) -> None:
    fields[section][new] = fields[section].pop(old)


@pytest.mark.parametrize("change, named", [
    (lambda m: _rename(m, "plan", "dtype", "serving_dtype"), r"unknown field `serving_dtype` - at `\$.plan`"),
    (lambda m: m["plan"].pop("page_size"), r"missing required field `page_size` - at `\$.plan`"),
    (lambda m: m["plan"].update(max_concurrency="4"), r"Expected `int`, got `str` - at `\$.plan.max_concurrency`"),
    (lambda m: m["payloads"][0].update(kind="weight"), r"'weight' - at `\$.payloads\[0\].kind`"),
    (lambda m: m["payloads"][1].update(sha256="abc"), r"at `\$.payloads\[1\].sha256`"),
    (lambda m: m["publisher"].pop("namespace"), r"missing required field `namespace` - at `\$.publisher`"),
    (lambda m: m.update(model_key="other"), r"model_key 'other' does not match model_id 'stories260k'"),
    (lambda m: m["deployments"][0]["ranks"][0].update(payloads=["weights/head.safetensors"]),
     r"names 'weights/head.safetensors', which is not a module-global payload"),
])
def test_a_malformed_manifest_is_refused_at_open_naming_the_field(export, approved, change, named):
    entry = export()
    _resign(entry, change)
    with pytest.raises(ManifestError, match=named) as refused:
        open_package(entry, approved)
    assert str(refused.value).startswith(f"{entry / fmt.PRIMARY_NAME}: the signed manifest is malformed")
    assert refused.value.exit_code == 5


def test_flare_inspect_reports_a_malformed_manifest_as_exit_5(export, capsys):
    entry = export()
    _resign(entry, lambda m: m["plan"].pop("dtype"))
    assert main(["inspect", str(entry), "--unverified"]) == 5
    assert "missing required field `dtype` - at `$.plan`" in capsys.readouterr().err
