"""The license a package records comes from the checkpoint's model card, as the hub spells it."""

from flare.package.manifest import License
from flare.prepare import CheckpointSource, _license


def write_card(directory, front_matter: str):
    (directory / "README.md").write_text(f"---\n{front_matter}---\n\n# A model\n")
    return CheckpointSource(directory=directory, repo_id="Org/Model", revision="abc123")


def test_a_named_license_links_to_the_model_card_at_its_revision(tmp_path):
    license = _license(write_card(tmp_path, "license: apache-2.0\n"))
    assert license == License(name="apache-2.0", link="https://huggingface.co/Org/Model/blob/abc123/README.md")


def test_license_other_uses_the_cards_license_name_and_link(tmp_path):
    card = "license: other\nlicense_name: psf-2.0\nlicense_link: https://docs.python.org/3/license.html\n"
    assert _license(write_card(tmp_path, card)) == License(name="psf-2.0",
                                                           link="https://docs.python.org/3/license.html")


def test_a_card_without_a_license_records_none(tmp_path):
    assert _license(write_card(tmp_path, "tags:\n- demo\n")) is None
