"""Push a verified export folder to the Hugging Face Hub.

Run:  python conversion/push.py DIR REPO_ID [--private] [--revision R] [--message M] [--dry-run]

Refuses a folder that ``conversion/verify.py`` has not passed (or that changed since: the
verification marker holds the SHA-256 of every file).  ``huggingface_hub``'s ``create_repo``
(with ``--private``) and ``upload_folder`` (to ``--revision``, created from ``main`` if missing)
do the work; the token and the endpoint come from the usual environment (``HF_TOKEN`` or
``hf auth login``, ``HF_ENDPOINT``).  ``--dry-run`` lists what would be uploaded and uploads nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from polar_vit_hf.cli import UserError, add_debug_flag, command
from polar_vit_hf.conversion.verify import MARKER, folder_digest


class PushError(UserError):
    """The folder may not be pushed."""


def check_verified(folder: Path) -> dict[str, str]:
    marker = folder / MARKER
    if not marker.exists():
        raise PushError(f"{folder} has not passed verification: run `python conversion/verify.py {folder}` first")
    recorded = json.loads(marker.read_text())["files"]
    current = folder_digest(folder)
    if recorded != current:
        changed = sorted(set(recorded.items()) ^ set(current.items()))
        raise PushError(
            f"{folder} changed since it was verified ({sorted({name for name, _ in changed})[:5]}); verify it again"
        )
    return current


def push(
    folder: Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    message: str | None = None,
    dry_run: bool = False,
) -> str | None:
    """Create the repo (and branch) if needed and upload the verified folder; returns the commit URL."""
    files = check_verified(folder)
    if dry_run:
        print(
            f"dry run: would upload {len(files)} files to {repo_id}"
            f"{f' (branch {revision})' if revision else ''}{' as a private repo' if private else ''}:"
        )
        for name in sorted(files):
            print(f"  {name}  ({(folder / name).stat().st_size:,} bytes)")
        return None
    from huggingface_hub import HfApi, get_token

    if get_token() is None:
        raise PushError("no Hugging Face token: set HF_TOKEN or run `hf auth login`")
    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision and revision != "main":
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    commit = api.upload_folder(
        folder_path=str(folder),
        repo_id=repo_id,
        revision=revision,
        commit_message=message or f"Upload Polar-ViT ({len(files)} files)",
        ignore_patterns=[MARKER],
    )
    print(
        f"pushed {len(files)} files to {commit.commit_url}\n"
        f"check the upload: python conversion/verify.py {repo_id} --source {folder}"
        f"{f' --revision {revision}' if revision else ''}"
    )
    return commit.commit_url


def publish(
    source: Path,
    repo_id: str | None = None,
    private: bool = False,
    revision: str | None = None,
    out_dir: Path | None = None,
) -> bool:
    """export -> verify -> push: a training output (any ``export.py`` source) to the Hub.

    The folder goes to ``out_dir`` (default ``SOURCE/hub_export``); ``repo_id`` defaults to
    ``<token's user>/<SOURCE name>``.  Returns False (and pushes nothing) if verification fails.
    """
    from polar_vit_hf.conversion.export import export
    from polar_vit_hf.conversion.verify import verify

    if repo_id is None:
        from huggingface_hub import HfApi

        repo_id = f"{HfApi().whoami()['name']}/{source.resolve().name}"
    folder = export(source, out_dir or source / "hub_export", repo_id=repo_id)
    if not verify(folder, source=source):
        print(f"push: {folder} failed verification; nothing was pushed", file=sys.stderr)
        return False
    push(folder, repo_id, private=private, revision=revision)
    return True


@command("polar-vit-push")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_debug_flag(parser)
    parser.add_argument("folder", type=Path)
    parser.add_argument("repo_id")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--revision")
    parser.add_argument("--message")
    parser.add_argument("--dry-run", action="store_true", dest="dry_run")
    args = parser.parse_args(argv)
    from huggingface_hub.errors import HfHubHTTPError

    try:
        push(args.folder, args.repo_id, args.private, args.revision, args.message, args.dry_run)
    except HfHubHTTPError as error:
        print(f"push: the Hub refused the upload to {args.repo_id}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
