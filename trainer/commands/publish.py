"""`dflash2 publish`: an existing export folder to the Hub as one commit, without re-exporting it.

dflash2 publish FOLDER REPO_ID [--private] [--commit-message MSG] [--revision R]

FOLDER: a folder written by `dflash2 export` (or `export_draft`), e.g. after its --push-to-hub
failed. It is re-validated against the public checkpoint contract before the Hub is contacted, and
only what export wrote is uploaded: no links, modeling files as this version ships them.
A failed push leaves no partial revision: run the same command again.
"""

from __future__ import annotations

import logging

from huggingface_hub import CommitInfo

from trainer.commands.runner import command_parser
from trainer.publishing.hub import DEFAULT_COMMIT_MESSAGE, PublishError, publish, publish_command


def main(argv: list[str] | None = None) -> CommitInfo:
    """Push the export folder as one commit; a failure names the command that retries it."""
    parser = command_parser("dflash2 publish", __doc__)
    parser.add_argument("folder", help="the export folder")
    parser.add_argument("repo_id", help="the Hub repository, owner/name")
    parser.add_argument("--private", action="store_true", help="create the repo private (an existing repo is kept)")
    parser.add_argument("--commit-message", default=DEFAULT_COMMIT_MESSAGE, help="of the one commit")
    parser.add_argument("--revision", help="branch to commit to (default: main)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    options = {"commit_message": args.commit_message, "revision": args.revision}
    try:
        commit = publish(args.folder, args.repo_id, private=args.private or None, **options)
    except PublishError as error:
        retry = publish_command(args.folder, args.repo_id, private=args.private, **options)
        raise PublishError(f"{error}: retry with {retry}") from error
    print(f"published {commit.commit_url}")
    return commit
