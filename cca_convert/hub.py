"""Talking to the Hugging Face Hub: fetch a source model, push an exported repo folder.

Everything goes through huggingface_hub, which honours HF_ENDPOINT, HF_TOKEN / `hf auth login`,
HF_HOME and HF_HUB_OFFLINE. Failures the user can fix become a one-line `CCAError`; the token is never
part of a message.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import huggingface_hub
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from .errors import CCAError, first_line

# What `resolve_source` downloads: config, safetensors weights, tokenizer and chat template files, top level only
# (no *.bin / *.pth / onnx / gguf, nothing under original/ or other sub-folders except extra chat templates).
SOURCE_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
]
# fnmatch's "*" also matches "/": keep weights in sub-folders (original/, onnx/, ...) out.
SOURCE_IGNORE_PATTERNS = ["*/*.safetensors", "*/*.safetensors.index.json"]

# Remote weight files that `push_folder` deletes when the local folder does not have them, so that a
# re-push with fewer shards (or safetensors replacing .bin) leaves no stale weights behind.
STALE_WEIGHT_PATTERNS = [
    "*.safetensors",
    "model.safetensors.index.json",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
]

LOGIN_HINT = "log in with `hf auth login` or set HF_TOKEN"


def is_hub_id(name: str) -> bool:
    """A Hub repo id (``owner/name``) that is not a path on this machine."""
    return not Path(name).exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None


def _endpoint() -> str:
    return constants.ENDPOINT.rstrip("/")


def _offline() -> bool:
    return bool(constants.HF_HUB_OFFLINE)


def _looks_like_path(source: str) -> bool:
    """A SOURCE the user meant as a folder: ./x, ../x, /x, ~/x, C:\\x, x/ or a/b/c (Hub ids have at most one /)."""
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return (
        source in (".", "..")
        or source.startswith(("./", "../", "/", "~", "." + os.sep, ".." + os.sep, os.sep))
        or source.endswith(tuple(seps))
        or bool(re.match(r"^[A-Za-z]:[\\/]", source))
        or sum(source.count(s) for s in seps) > 1
        or (os.sep != "/" and os.sep in source)
    )


def _is_connection_error(exc: BaseException) -> bool:
    """True when `exc` (or what caused it) is a network failure: httpx (hf_hub 1.x), httpx2 (2.x) or requests."""
    names = {"ConnectError", "ConnectTimeout", "TimeoutException", "ReadTimeout", "NetworkError", "ProxyError",
             "ConnectionError", "RemoteProtocolError"}
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionError, TimeoutError)) or any(c.__name__ in names for c in type(exc).__mro__):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _unreachable(action: str, exc: BaseException) -> CCAError:
    return CCAError(
        f"could not reach the Hub at {_endpoint()} to {action} ({type(exc).__name__}): check your network and "
        "HF_ENDPOINT, or pass a local model folder instead (with HF_HUB_OFFLINE=1 only the local cache is used)"
    )


def no_safetensors(where) -> str:
    """The refusal of a model without safetensors weights (``.bin`` / ``.pth`` are pickles: not read here), with the
    conversion that fixes it."""
    return (f"{where} has no *.safetensors weights (cca-convert does not read .bin/.pth pickles): convert them with "
            "transformers, `AutoModelForCausalLM.from_pretrained(SRC).save_pretrained(DST)` (plus the tokenizer's "
            "save_pretrained(DST)), and pass DST")


# ----------------------------------------------------------------------------------------------------------------------
# Download
# ----------------------------------------------------------------------------------------------------------------------
def resolve_source(source: str, revision: str | None = None) -> Path:
    """The local folder of the model SOURCE: SOURCE itself if it is a folder, else the Hub model id SOURCE
    (at `revision`) downloaded into the Hub cache (only config, safetensors weights and tokenizer files)."""
    path = Path(source).expanduser()
    if path.is_dir():
        if revision is not None:
            raise CCAError(f"--revision applies to Hub model ids, but {source} is a local folder: drop --revision")
        return path
    if path.exists():
        raise CCAError(f"{source} is a file: pass the model folder (with config.json and *.safetensors)")
    if _looks_like_path(source):
        raise CCAError(f"no such folder: {source} (for a Hub model pass its id, like 'meta-llama/Llama-3.2-1B')")
    try:
        validate_repo_id(source)
    except HFValidationError:
        raise CCAError(f"{source!r} is neither a local folder nor a valid Hub model id (like 'org/name')") from None

    try:
        folder = huggingface_hub.snapshot_download(
            source,
            revision=revision,
            allow_patterns=SOURCE_ALLOW_PATTERNS,
            ignore_patterns=SOURCE_IGNORE_PATTERNS,
        )
    except Exception as exc:
        err = _download_error(exc, source, revision)
        if err is None:
            raise
        if str(err).startswith(("could not reach", "HF_HUB_OFFLINE")):  # maybe a folder name without ./
            err = CCAError(f"{err}; there is no local folder {source!r} either (relative to {Path.cwd()})")
        raise err from exc

    folder = Path(folder)
    where = source if revision is None else f"{source}@{revision}"
    if not (folder / "config.json").is_file():
        raise CCAError(f"{where} has no config.json: it is not a transformers model repo")
    if not any(folder.glob("*.safetensors")):
        raise CCAError(no_safetensors(where))
    return folder


def _download_error(exc: BaseException, repo_id: str, revision: str | None) -> CCAError | None:
    url = f"{_endpoint()}/{repo_id}"
    if isinstance(exc, GatedRepoError):  # before RepositoryNotFoundError: it is a subclass
        return CCAError(f"{repo_id} is gated: accept the license at {url} and {LOGIN_HINT} (or pass a local folder)")
    if isinstance(exc, RevisionNotFoundError):
        return CCAError(f"revision {revision!r} not found in {repo_id}: pass an existing branch, tag or commit sha")
    if isinstance(exc, RepositoryNotFoundError) and not _bad_token(exc):
        private_hint = (
            "if it is private, check that your token can read it"
            if huggingface_hub.get_token()
            else f"if it is private, {LOGIN_HINT}"
        )
        return CCAError(
            f"model {repo_id!r} not found on {_endpoint()} and no local folder has that name: "
            f"check for a typo; {private_hint}"
        )
    if isinstance(exc, HfHubHTTPError) and _http_status(exc) == 401:
        return CCAError(f"the Hub rejected your token (401) while downloading {repo_id}: {LOGIN_HINT} with a valid token")
    if _offline() or isinstance(exc, OfflineModeIsEnabled):
        return CCAError(
            f"HF_HUB_OFFLINE is set and {repo_id} is not (fully) in the local Hub cache: pass a local model "
            "folder, or unset HF_HUB_OFFLINE to download it"
        )
    if isinstance(exc, LocalEntryNotFoundError) and isinstance(exc.__cause__, HfHubHTTPError):
        return _download_error(exc.__cause__, repo_id, revision)  # the Hub answered, with an error
    if _is_connection_error(exc) or isinstance(exc, LocalEntryNotFoundError):
        return _unreachable(f"download {repo_id}", exc)
    if isinstance(exc, HfHubHTTPError):
        return CCAError(f"downloading {repo_id} failed: HTTP {_http_status(exc)} from {_endpoint()}: "
                        f"{first_line(exc)}")
    return None


def _bad_token(exc: BaseException) -> bool:
    response = getattr(exc, "response", None)
    message = response.headers.get("X-Error-Message", "") if response is not None else ""
    return _http_status(exc) == 401 and "Invalid credentials" in message


# ----------------------------------------------------------------------------------------------------------------------
# Upload
# ----------------------------------------------------------------------------------------------------------------------
def check_push_target(repo_id: str, *, revision: str | None, create_pr: bool, revision_flag: str = "--hub-revision") -> None:
    """What a push needs before any upload: online, a valid repo id, consistent options, a token.
    Run by `push_folder`, and by the CLI before a long conversion that ends in a push."""
    if _offline():
        raise CCAError("HF_HUB_OFFLINE is set: unset it to push to the Hub")
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise CCAError(f"{repo_id!r} is not a valid Hub repo id (like 'your-name/model-cca')") from None
    if create_pr and revision not in (None, constants.DEFAULT_REVISION):
        raise CCAError(f"a pull request is always opened against main: drop {revision_flag} {revision} or --create-pr")
    if not huggingface_hub.get_token():
        raise CCAError(f"pushing to the Hub needs a token with write access: {LOGIN_HINT}")
    check_write_access(repo_id)


def check_write_access(repo_id: str) -> None:
    """The token is valid (whoami), not read-only, and its account may write to the repo's namespace."""
    try:
        me = HfApi().whoami()
    except Exception as exc:
        if _is_connection_error(exc):
            raise _unreachable("check your token", exc) from None
        if _http_status(exc) == 401:
            raise CCAError(f"the Hub rejected your token (401): {LOGIN_HINT} with a valid token that can write") from None
        raise
    access = (me.get("auth") or {}).get("accessToken") or {}
    if access.get("role") == "read":
        raise CCAError(f"your token is read-only: pushing to {repo_id} needs a token with write access ({LOGIN_HINT})")
    namespace = repo_id.split("/")[0] if "/" in repo_id else me.get("name")
    accounts = [me.get("name")] + [org.get("name") for org in me.get("orgs") or []]
    if access.get("role") != "fineGrained" and namespace not in accounts:  # fine-grained scopes are checked on push
        raise CCAError(f"your token belongs to {me.get('name')!r}, which cannot create or write repos under "
                       f"{namespace!r} (accounts: {', '.join(a for a in accounts if a)}): push to one of yours")


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
) -> str:
    """Upload `folder` to the model repo `repo_id` (created if missing) in one commit and return the commit URL,
    or the pull request URL with `create_pr`. With `revision`, commit to that branch (created from main if
    missing; not together with `create_pr`, whose PR targets main). Remote weight files the folder does not have are deleted (STALE_WEIGHT_PATTERNS). Re-running after
    an interrupted upload does not re-send the files that finished (the LFS batch API skips them)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CCAError(f"no such folder to push: {folder}")
    check_push_target(repo_id, revision=revision, create_pr=create_pr)

    api = HfApi()  # created now: picks up the current HF_ENDPOINT
    step = "create the repo"
    try:
        # private=None (not False) leaves a new repo to the namespace's default visibility
        repo_id = api.create_repo(repo_id, private=True if private else None, exist_ok=True).repo_id
        if revision is not None and revision != constants.DEFAULT_REVISION and not revision.startswith("refs/pr/"):
            step = f"create branch {revision}"
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        step = "upload"
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            revision=revision,
            create_pr=create_pr,
            commit_message=commit_message or f"Upload {folder.name} with cca-convert",
            delete_patterns=STALE_WEIGHT_PATTERNS,
        )
    except Exception as exc:
        err = _upload_error(exc, repo_id, step)
        if err is None:
            raise
        raise err from exc
    return str(getattr(info, "pr_url", None) or info.commit_url)


def _upload_error(exc: BaseException, repo_id: str, step: str) -> CCAError | None:
    status = _http_status(exc)
    if isinstance(exc, HfHubHTTPError) and (status == 401 or _bad_token(exc)):
        return CCAError(f"the Hub rejected your token (401) trying to {step} for {repo_id}: {LOGIN_HINT} "
                        "with a token that has write access")
    if isinstance(exc, HfHubHTTPError) and status == 403:
        return CCAError(f"no write access to {repo_id} (403) trying to {step}: use a token with write access "
                        "to that namespace, or push to your own namespace")
    if isinstance(exc, RevisionNotFoundError):
        return CCAError(f"revision not found in {repo_id} trying to {step}: {first_line(exc)}")
    # huggingface_hub wraps a failed LFS transfer in RuntimeError("Error while uploading 'path' to the Hub.")
    lfs_failure = isinstance(exc, RuntimeError) and isinstance(exc.__cause__, (HfHubHTTPError, OSError))
    if step == "upload" and (lfs_failure or _is_connection_error(exc)):
        cause = exc.__cause__ if lfs_failure else exc
        reason = f"HTTP {_http_status(cause)}" if _http_status(cause) else type(cause).__name__
        sending = re.search(r"uploading '(.+?)'", str(exc))
        return CCAError(
            f"upload to {repo_id} at {_endpoint()} was interrupted"
            + (f" while sending {sending[1]}" if sending else "")
            + f" ({reason}): run the same command again to resume; files already uploaded are not sent again"
        )
    if _is_connection_error(exc):
        return _unreachable(f"{step} for {repo_id}", exc)
    if isinstance(exc, HfHubHTTPError):
        return CCAError(f"could not {step} for {repo_id}: HTTP {status}: {first_line(exc)}")
    return None
