"""Publishing an exported folder to the Hub: ``cca-convert push DIR REPO`` and the pipeline's ``push`` stage
(``--push-to-hub REPO``), both through ``hub.push_folder``.

The token comes from where huggingface_hub looks (HF_TOKEN, ``hf auth login``); it is never printed or
written. A folder whose ``validation/report.json`` failed its gates is refused unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .errors import CCAError


def check_export(folder: Path) -> None:
    """CCAError unless ``folder`` holds a model cca-convert exported (any method's config, or the first releases'
    ``model_type: cca``): pushing rewrites the folder's card, which must not happen to a base model's folder."""
    from . import methods

    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CCAError(f"{folder / 'config.json'} is not readable JSON ({type(exc).__name__}): pass a folder exported "
                       "by cca-convert") from None
    if not isinstance(raw, dict) or (methods.of_config(raw) is None and raw.get("model_type") != "cca"):
        raise CCAError(f"{folder} is not a model exported by cca-convert (its config.json has the settings of none of "
                       f"its methods: {', '.join(methods.METHODS)}): `cca-convert push` uploads a conversion's output "
                       "folder; convert the model first (`cca-convert SOURCE --push-to-hub REPO` does both), or upload "
                       "another folder with `hf upload`")


def check_report(folder: Path, force: bool, log=print) -> dict | None:
    """The folder's validation report; CCAError if it failed its gates (unless ``force``)."""
    path = Path(folder) / "validation" / "report.json"
    if not path.is_file():
        log(f"note: {folder} has no validation/report.json (validation was skipped); pushing without it")
        return None
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CCAError(f"{path} is not a readable validation report ({type(exc).__name__}): re-run "
                       f"`cca-convert validate {folder}`") from None
    if not report.get("passed", False):
        why = report.get("failed_gates") or "see validation/report.md"
        if not force:
            raise CCAError(f"{folder} failed its validation gates ({why}); refusing to push. Fix the model or the "
                           "gates and re-run `cca-convert validate`, or pass --force to push it anyway")
        log(f"WARNING: pushing a folder that failed its validation gates (--force): {why}")
    return report


def preflight(repo_id: str, *, revision: str | None, create_pr: bool) -> None:
    """``--push-to-hub`` checks that need no upload, run before a long conversion."""
    from .hub import check_push_target

    try:
        check_push_target(repo_id, revision=revision, create_pr=create_pr, revision_flag="--hub-revision")
    except CCAError as exc:
        raise CCAError(f"--push-to-hub: {exc}") from None


def _commit_message(folder: Path, report: dict | None) -> str:
    msg = f"Upload {folder.name} with cca-convert"
    if report is not None:
        msg += "; validation " + ("passed" if report.get("passed") else "FAILED (pushed with --force)")
    return msg


def push(folder: Path, repo_id: str, *, private: bool = False, revision: str | None = None, create_pr: bool = False,
         force: bool = False, log=print) -> str:
    from .hub import push_folder

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CCAError(f"{folder} has no config.json: pass a folder exported by cca-convert")
    check_export(folder)  # before anything is read further or its card rewritten: it may be someone's base model
    report = check_report(folder, force, log)
    from .hub import check_push_target
    from .model_card import retarget

    check_push_target(repo_id, revision=revision, create_pr=create_pr)  # before the card is touched
    if retarget(folder / "README.md", repo_id):  # the pushed card loads the pushed id (the folder's copy too)
        log(f"  model card: snippets and title now name {repo_id}")
    url = push_folder(folder, repo_id, private=private, revision=revision, create_pr=create_pr,
                      commit_message=_commit_message(folder, report))
    log(f"  pushed {folder} to {repo_id}: {url}")
    return url


def stage_push(job) -> None:
    """Last stage, after the output folder was committed."""
    try:
        job.push_url = push(job.output, job.push_to_hub, private=job.private, revision=job.hub_revision,
                            create_pr=job.create_pr, force=job.force, log=job.log)
    except CCAError as exc:
        opts = "".join([" --private" * job.private, f" --hub-revision {job.hub_revision}" * bool(job.hub_revision),
                        " --create-pr" * job.create_pr, " --force" * job.force])
        raise CCAError(f"{exc} [the converted model is complete in {job.output}: upload it with "
                       f"`cca-convert push {job.output} {job.push_to_hub}{opts}`]") from None


def push_parser() -> argparse.ArgumentParser:
    from .argparsing import OneLineParser

    p = OneLineParser(
        prog="cca-convert push",
        description="Upload an exported folder to a Hub model repo (created if missing) in one commit. The token "
                    "comes from HF_TOKEN or `hf auth login`.",
        epilog="examples:\n  cca-convert push out/tiny-cca your-name/tiny-cca\n"
               "  cca-convert push llama-3.1-8b-cca org/llama-3.1-8b-cca --private --hub-revision v1\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("folder", type=Path, metavar="DIR", help="folder written by cca-convert")
    p.add_argument("repo_id", metavar="REPO", help="Hub repo id, e.g. your-name/model-cca")
    add_push_options(p, flag_names=False)
    p.add_argument("--force", action="store_true", help="push even if the folder failed its validation gates")
    return p


def add_push_options(p: argparse.ArgumentParser, flag_names: bool = True) -> None:
    """--private, --hub-revision, --create-pr (and, for the convert command, --push-to-hub REPO)."""
    if flag_names:
        p.add_argument("--push-to-hub", metavar="REPO", help="after a successful export, upload the folder to this "
                                                            "Hub repo (created if missing)")
    p.add_argument("--private", action="store_true", help="create the Hub repo private (an existing repo keeps its "
                                                          "visibility)")
    p.add_argument("--hub-revision", metavar="BRANCH", help="push to this branch of the Hub repo (created from main)")
    p.add_argument("--create-pr", action="store_true", help="open a pull request against main instead of committing")


def run_push(argv: list[str]) -> int:
    args = push_parser().parse_args(argv)
    if not args.folder.is_dir():
        raise CCAError(f"no such folder to push: {args.folder}")
    push(args.folder, args.repo_id, private=args.private, revision=args.hub_revision, create_pr=args.create_pr,
         force=args.force)
    return 0
