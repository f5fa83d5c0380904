"""Where downloaded cache entries came from: the recorded download origins.

    <cache>/sources/<repository-key>.json    {"repository": "Org/Name", "records": [record, ...]}

Each successful download appends a record: the request (the revision asked for and the filename asked
for; none means the primary was selected automatically), the commit it resolved to, the primary it
selected, the tensor-parallel selection, the installed entry, and the SHA-256 of the entry's signed
envelope (its primary file, holding the signed manifest and signature) as authenticated during
acquisition. Lookups take the latest matching record, so a branch resolves its last successfully
acquired commit, while an older entry keeps its own origin after the branch moves on. Downloading the
same request, commit and entry again moves its record to the end instead of adding another.

Offline resolution reads only these records, never the hub cache. A record without an envelope hash is
unbound: it stays readable but offline resolution refuses it. Locally exported entries have no record.
"""

from __future__ import annotations

import datetime
import json
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from flare.package.format import PRIMARY_NAME
from flare.package.store import EntryId, ModelCache, model_key_for, sha256_file

SOURCES_DIR = "sources"


@dataclass(frozen=True)
class SourceRecord:
    repository: str                  # as the user spelled it
    requested_revision: str          # branch, tag or commit asked for ("main" when none was given)
    requested_filename: str | None   # --filename, or None when the primary was selected automatically
    commit: str                      # what the revision resolved to when this entry was acquired
    filename: str                    # the repository-relative primary that was installed
    tensor_parallel: int | None      # the --gpus selection, None when none was given
    model_key: str
    version: str
    envelope_sha256: str | None      # None: an unbound record
    downloaded_at: str = ""

    @property
    def entry(self) -> EntryId:
        return EntryId(self.model_key, self.version)

    @property
    def request(self) -> tuple[str, str | None]:
        return self.requested_revision, self.requested_filename

    @classmethod
    def from_json(cls, fields: dict, repository: str) -> SourceRecord:
        return cls(repository=fields.get("repository", repository),
                   requested_revision=fields["requested_revision"],
                   requested_filename=fields.get("requested_filename"),
                   commit=fields["commit"], filename=fields["filename"],
                   tensor_parallel=fields.get("tensor_parallel"),
                   model_key=fields["model_key"], version=fields["version"],
                   envelope_sha256=fields.get("envelope_sha256"),
                   downloaded_at=fields.get("downloaded_at", ""))


def envelope_sha256(entry_dir: Path) -> str:
    """The SHA-256 of an entry's signed envelope: its primary file's exact bytes."""
    return sha256_file(Path(entry_dir) / PRIMARY_NAME)


class SourceRecords:
    """The download origins recorded in one model cache."""

    def __init__(self, cache: ModelCache):
        self.cache = cache
        self.root = cache.root / SOURCES_DIR

    def path_for(self, repository: str) -> Path:
        # Hub repository ids match without regard to casing, so their records do too.
        return self.root / f"{model_key_for(repository.casefold())}.json"

    def records(self, repository: str) -> list[SourceRecord]:
        return _read_records(self.path_for(repository), repository)

    def add(self, record: SourceRecord) -> None:
        """Record a successful download as the latest of its request."""
        if not record.downloaded_at:
            now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            record = SourceRecord(**{**asdict(record), "downloaded_at": now})
        with self.cache.lock(f"sources-{self.path_for(record.repository).stem}"):
            same = (record.request, record.commit, record.entry)
            kept = [r for r in self.records(record.repository) if (r.request, r.commit, r.entry) != same]
            self._write(record.repository, kept + [record])

    def _write(self, repository: str, records: list[SourceRecord]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.path_for(repository)
        document = {"repository": repository, "records": [asdict(r) for r in records]}
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        temporary.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        os.replace(temporary, path)

    def find(self, repository: str, revision: str, filename: str | None) -> SourceRecord | None:
        """The latest record of this request: the revision asked for (or, for a commit, acquired at it) and
        the filename asked for (None only matches a download that selected its primary automatically)."""
        matching = [r for r in self.records(repository)
                    if (r.requested_revision == revision or r.commit == revision)
                    and r.requested_filename == filename]
        return matching[-1] if matching else None       # records are kept in the order they were written

    def find_commit(self, repository: str, commit: str, filename: str | None) -> SourceRecord | None:
        """The latest record that installed this commit for the same filename request."""
        matching = [r for r in self.records(repository) if r.commit == commit and r.requested_filename == filename]
        return matching[-1] if matching else None

    def origin_of_path(self, path: Path) -> SourceRecord | None:
        """The download origin of the cache entry at `path` (None outside the cache or when exported locally)."""
        entry = self.cache.entry_for_path(path)
        return self.origin_of(entry) if entry is not None else None

    def prune_removed(self) -> list[str]:
        """Drop the records of entries no longer in the cache (a repository file with none left goes too);
        returns "Org/Name@commit -> model@version" for each record dropped."""
        dropped = []
        for path in sorted(self.root.glob("*.json")) if self.root.is_dir() else []:
            with self.cache.lock(f"sources-{path.stem}"):
                records = _read_records(path, "")
                kept = [r for r in records if self.cache.entry_path(r.entry).is_dir()]
                dropped += [f"{r.repository}@{r.commit} -> {r.entry}" for r in records if r not in kept]
                if not kept:
                    path.unlink(missing_ok=True)
                elif len(kept) < len(records):
                    self._write(kept[0].repository, kept)
        return dropped

    def origin_of(self, entry: EntryId) -> SourceRecord | None:
        """The latest download that installed `entry`, or None for an entry exported locally."""
        latest = None
        for path in sorted(self.root.glob("*.json")) if self.root.is_dir() else []:
            for record in _read_records(path, ""):
                if record.entry == entry and (latest is None or record.downloaded_at >= latest.downloaded_at):
                    latest = record
        return latest


def _read_records(path: Path, repository: str) -> list[SourceRecord]:
    """A repository's records in the order they were written; an unreadable file is no record (download again)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    records = []
    for fields in document.get("records", []):
        try:
            records.append(SourceRecord.from_json(fields, document.get("repository", repository)))
        except (KeyError, TypeError):
            continue
    return records
