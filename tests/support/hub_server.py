"""A small in-memory Hugging Face Hub for tests, and the ``hub_server`` pytest fixture.

It implements the part of the Hub API that huggingface_hub (1.x, 2.x) and transformers (5.x) use to
create a repo, upload a folder (preupload, LFS batch + PUT + verify, ndjson commit), create branches
and pull requests, and download files (repo info, tree listing, resolve). Only the standard library
is used (``http.server``), so it runs anywhere. See /work/shared/HUB-API-NOTES.md for the protocol.

Model
    Every repo holds immutable commits (40-hex sha, a full ``{path: Blob}`` snapshot each) and refs:
    branches (``main``, ...) and pull requests (``refs/pr/N``). LFS objects are stored per repo by
    sha256 as soon as their PUT completes, so an LFS batch for an object the repo already has gets no
    ``actions`` and the client skips it (that is what makes an interrupted upload resumable).
    Model repos only (ids ``namespace/name``, or canonical ones like ``gpt2``).

Auth
    Requests may carry ``Authorization: Bearer <token>``. Tokens in ``Hub.valid_tokens`` are accepted
    (the fixture's fake token by default); any other token gets 401 "Invalid credentials". Writes need
    a valid token. Private repos are visible with a valid token. Gated repos refuse file downloads
    (401 without a token, 403 with one; ``X-Error-Code: GatedRepo``), like the real Hub; with
    ``Hub.gate_metadata = True`` repo info and tree listings are refused too. The request log records
    whether a token was sent and whether it was valid, never its value; nothing is printed.

Use as a pytest plugin (``pytest_plugins = ["tests.support.hub_server"]`` in conftest.py, or import the
``hub_server`` fixture into a test module)::

    def test_x(hub_server):
        hub_server.create_repo_with_files("user/src", {"config.json": b"{}"})
        path = huggingface_hub.hf_hub_download("user/src", "config.json")   # goes to hub_server.url
        hub_server.run_python("from transformers import AutoConfig; AutoConfig.from_pretrained('user/src')")

``python tests/support/hub_server.py`` serves it on 127.0.0.1 until interrupted (for manual checks).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

from .child_env import checkout_env

FAKE_TOKEN = "hf_cca_test_token_not_a_secret_0123456789"
USERNAME = "user"  # the account the fake token belongs to (namespace for `create_repo("name")`)
REPO_ROOT = Path(__file__).resolve().parents[2]

# The server decides what goes through LFS, like the Hub's default .gitattributes + its size limit.
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.onnx", "*.gguf", "*.model",
                "*.msgpack", "*.npy", "*.npz", "*.pkl", "*.tar.gz", "*.zip")
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()


def git_blob_oid(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as a regular file's oid / ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def must_be_lfs(path: str, size: int, sample: bytes = b"") -> bool:
    return (any(fnmatch.fnmatch(path, p) for p in LFS_PATTERNS) or size >= LFS_SIZE_THRESHOLD
            or b"\0" in sample)


# ----------------------------------------------------------------------------------------------------------------------
# Storage
# ----------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Blob:
    data: bytes
    lfs: bool
    sha256: str
    git_oid: str  # for LFS files: the oid of the pointer file, as on the Hub

    @classmethod
    def make(cls, data: bytes, lfs: bool) -> "Blob":
        sha256 = hashlib.sha256(data).hexdigest()
        oid = git_blob_oid(cls.pointer(sha256, len(data)) if lfs else data)
        return cls(data, lfs, sha256, oid)

    @staticmethod
    def pointer(sha256: str, size: int) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()

    @property
    def etag(self) -> str:  # what names the blob in the client's cache
        return self.sha256 if self.lfs else self.git_oid


@dataclass(frozen=True)
class Commit:
    sha: str
    parent: str | None
    files: dict[str, Blob]
    title: str
    date: str


@dataclass
class Repo:
    repo_id: str
    private: bool = False
    gated: bool = False
    commits: dict[str, Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # "main" / "my-branch" / "refs/pr/1" -> commit sha
    lfs_objects: dict[str, bytes] = field(default_factory=dict)  # sha256 -> content, once its PUT completed
    next_pr: int = 1

    def resolve(self, rev: str) -> Commit | None:
        rev = rev.removeprefix("refs/heads/")
        if rev in self.refs:
            return self.commits[self.refs[rev]]
        if re.fullmatch(r"[0-9a-f]{40}", rev):
            return self.commits.get(rev)
        return None


class HubError(Exception):
    """Becomes an HTTP error response with the Hub's X-Error-Code / X-Error-Message headers."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, dict(headers or {})


@dataclass
class Request:
    method: str
    path: str  # unquoted
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: bytes
    auth: str | None  # None (no token), "valid" or "invalid"
    params: dict[str, str]  # unquoted route groups

    def json(self):
        return json.loads(self.body or b"{}")

    def flag(self, name: str) -> bool:
        return self.query.get(name, [""])[0].lower() in ("1", "true")


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, obj, status: int = 200, headers: dict | None = None) -> "Response":
        return cls(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})


@dataclass(frozen=True)
class LoggedRequest:
    """One request as the server saw it: no header values, so no token."""

    method: str
    path: str  # unquoted, without the query string
    query: str
    status: int
    auth: str | None  # None: no Authorization header; "valid" / "invalid": a token was sent
    raw_path: str = ""  # as sent (URL-quoted: a revision "refs/pr/1" is one segment, refs%2Fpr%2F1)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


# ----------------------------------------------------------------------------------------------------------------------
# The Hub: state + one method per endpoint
# ----------------------------------------------------------------------------------------------------------------------
SEG = r"[^/]+"
REPO = rf"(?P<repo>(?:{SEG}/)?{SEG})"  # namespace/name, or a canonical id without namespace ("gpt2")
ROUTES: list[tuple[tuple[str, ...], re.Pattern, str]] = [
    (methods, re.compile(pattern), name)
    for methods, pattern, name in [
        (("GET",), r"/api/whoami-v2", "whoami"),
        (("POST",), r"/api/repos/create", "create_repo"),
        (("POST",), r"/api/validate-yaml", "validate_yaml"),
        (("GET",), rf"/api/models/{REPO}", "repo_info"),
        (("GET",), rf"/api/models/{REPO}/revision/(?P<rev>.+)", "repo_info"),
        (("GET",), rf"/api/models/{REPO}/tree/(?P<rev>{SEG})(?:/(?P<path>.*))?", "tree"),
        (("GET",), rf"/api/models/{REPO}/refs", "refs"),
        (("POST",), rf"/api/models/{REPO}/preupload/(?P<rev>{SEG})", "preupload"),
        (("POST",), rf"/api/models/{REPO}/commit/(?P<rev>{SEG})", "commit"),
        (("POST", "DELETE"), rf"/api/models/{REPO}/branch/(?P<branch>{SEG})", "branch"),
        (("POST",), rf"/{REPO}\.git/info/lfs/objects/batch", "lfs_batch"),
        (("POST",), rf"/{REPO}\.git/info/lfs/objects/verify", "lfs_verify"),
        (("PUT",), rf"/lfs-upload/{REPO}/(?P<oid>[0-9a-f]{{64}})", "lfs_put"),
        (("HEAD", "GET"), rf"/{REPO}/resolve/(?P<rev>{SEG})/(?P<path>.+)", "resolve"),
    ]
]
WRITE_ROUTES = {"create_repo", "preupload", "commit", "branch", "lfs_batch", "lfs_verify"}


class Hub:
    """The server's state and API. Thread-safe: every endpoint runs under one lock."""

    def __init__(self, base_url: str = ""):
        self.base_url = base_url
        self.repos: dict[str, Repo] = {}
        self.valid_tokens: set[str] = {FAKE_TOKEN}
        self.gate_metadata = False  # True: gated repos also refuse repo info and tree listings
        self.tree_page_size = 1000  # entries per tree page (Link: rel="next" pagination)
        self.request_log: list[LoggedRequest] = []
        self.fail_lfs_after: int | None = None  # fail every LFS PUT after this many succeeded
        self.lfs_puts_ok = 0
        self._lock = threading.RLock()
        self._counter = itertools.count()

    # -- helpers used by the fixture --------------------------------------------------------------------------------
    def add_repo(self, repo_id: str, *, private: bool = False, gated: bool = False) -> Repo:
        with self._lock:
            repo = Repo(repo_id, private=private, gated=gated)
            first = self._new_commit(repo, None, {".gitattributes": Blob.make(GITATTRIBUTES, lfs=False)},
                                     "initial commit")
            repo.refs["main"] = first.sha
            self.repos[repo_id] = repo
            return repo

    def _new_commit(self, repo: Repo, parent: Commit | None, files: dict[str, Blob], title: str) -> Commit:
        listing = sorted((p, b.git_oid) for p, b in files.items())
        seed = json.dumps([repo.repo_id, parent and parent.sha, listing, title, next(self._counter)])
        commit = Commit(hashlib.sha1(seed.encode()).hexdigest(), parent and parent.sha, dict(files), title, _now())
        repo.commits[commit.sha] = commit
        return commit

    # -- dispatch ---------------------------------------------------------------------------------------------------
    def handle(self, method: str, raw_path: str, headers: dict[str, str], body: bytes) -> Response:
        split = urlsplit(raw_path)
        auth_header = headers.get("authorization", "")
        token = auth_header[7:].strip() if auth_header.lower().startswith("bearer ") else None
        auth = None if not token else ("valid" if token in self.valid_tokens else "invalid")
        try:
            for methods, regex, name in ROUTES:
                match = regex.fullmatch(split.path)
                if match and method in methods:
                    break
            else:
                raise HubError(404, f"Not found: {method} {unquote(split.path)}")
            params = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
            req = Request(method, unquote(split.path), parse_qs(split.query), headers, body, auth, params)
            if auth == "invalid" and name != "lfs_put":
                raise HubError(401, "Invalid credentials in Authorization header")
            if name in WRITE_ROUTES and auth != "valid":
                raise HubError(401, "You must be authenticated to do this: pass a token")
            with self._lock:
                response = getattr(self, f"api_{name}")(req)
        except HubError as err:
            response = Response.json({"error": err.message}, err.status,
                                     {"X-Error-Message": err.message, **err.headers})
            if err.code:
                response.headers["X-Error-Code"] = err.code
        except Exception as err:  # a bug in this server: make it visible in the test's failure
            response = Response.json({"error": f"test hub server crashed: {err!r}"}, 500)
        with self._lock:
            self.request_log.append(
                LoggedRequest(method, unquote(split.path), split.query, response.status, auth, split.path))
        return response

    # -- access checks ----------------------------------------------------------------------------------------------
    def _repo(self, req: Request, *, files: bool = False) -> Repo:
        repo = self.repos.get(req.params["repo"])
        if repo is None or (repo.private and req.auth != "valid"):
            raise HubError(404 if req.auth else 401, "Repository not found", "RepoNotFound")
        if repo.gated and (files or self.gate_metadata):
            raise HubError(403 if req.auth else 401,
                           f"Access to model {repo.repo_id} is restricted. You must have access to it and be "
                           "authenticated to access it. Please log in.", "GatedRepo")
        return repo

    @staticmethod
    def _commit(repo: Repo, rev: str) -> Commit:
        commit = repo.resolve(rev)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return commit

    # -- endpoints --------------------------------------------------------------------------------------------------
    def api_whoami(self, req: Request) -> Response:
        if req.auth != "valid":
            raise HubError(401, "Invalid credentials in Authorization header")
        return Response.json({"type": "user", "name": USERNAME, "orgs": [],
                              "auth": {"type": "access_token", "accessToken": {"role": "write"}}})

    def api_create_repo(self, req: Request) -> Response:
        data = req.json()
        if data.get("type", "model") != "model":
            raise HubError(400, "this test hub only hosts model repos")
        repo_id = f"{data.get('organization') or USERNAME}/{data['name']}"
        url = f"{self.base_url}/{repo_id}"
        if repo_id in self.repos:
            return Response.json({"error": "You already created this model repo", "url": url}, 409)
        private = data.get("visibility", "private" if data.get("private") else "public") != "public"
        self.add_repo(repo_id, private=private)
        return Response.json({"url": url, "name": repo_id, "id": repo_id})

    def api_validate_yaml(self, req: Request) -> Response:
        return Response.json({"errors": [], "warnings": []})

    def api_repo_info(self, req: Request) -> Response:
        repo = self._repo(req)
        commit = self._commit(repo, req.params.get("rev", "main"))
        siblings = []
        for path, blob in sorted(commit.files.items()):
            sibling = {"rfilename": path, "size": len(blob.data), "blobId": blob.git_oid}
            if blob.lfs:
                sibling["lfs"] = {"sha256": blob.sha256, "size": len(blob.data),
                                  "pointerSize": len(Blob.pointer(blob.sha256, len(blob.data)))}
            siblings.append(sibling)
        namespace = repo.repo_id.split("/")[0]
        return Response.json({
            "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24], "id": repo.repo_id, "modelId": repo.repo_id,
            "author": namespace, "sha": commit.sha, "lastModified": commit.date, "createdAt": commit.date,
            "private": repo.private, "gated": "auto" if repo.gated else False, "disabled": False,
            "downloads": 0, "likes": 0, "tags": [], "library_name": "transformers", "siblings": siblings,
        })

    def api_tree(self, req: Request) -> Response:
        repo = self._repo(req)
        commit = self._commit(repo, req.params["rev"])
        base = req.params.get("path", "").strip("/")
        prefix = f"{base}/" if base else ""
        recursive = req.flag("recursive")
        if base and base in commit.files:
            raise HubError(404, f"{base} is a file, not a folder", "EntryNotFound")
        files, folders = [], set()
        for path in sorted(commit.files):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix):].split("/")
            for depth in range(1, len(parts)):  # the folders between `base` and the file
                if recursive or depth == 1:
                    folders.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                files.append(path)
        if base and not files and not folders:
            raise HubError(404, f"{base} does not exist in {req.params['rev']}", "EntryNotFound")
        entries = [{"type": "directory", "path": p, "oid": hashlib.sha1(p.encode()).hexdigest()} for p in sorted(folders)]
        for path in files:
            blob = commit.files[path]
            entry = {"type": "file", "path": path, "size": len(blob.data), "oid": blob.git_oid}
            if blob.lfs:
                entry["lfs"] = {"oid": blob.sha256, "size": len(blob.data),
                                "pointerSize": len(Blob.pointer(blob.sha256, len(blob.data)))}
            entries.append(entry)
        start = int(req.query.get("cursor", ["0"])[0])
        page, headers = entries[start:start + self.tree_page_size], {}
        if start + self.tree_page_size < len(entries):
            query = {k: v[0] for k, v in req.query.items()} | {"cursor": str(start + self.tree_page_size)}
            link = quote(req.path, safe="/") + "?" + "&".join(f"{k}={quote(v)}" for k, v in query.items())
            headers["Link"] = f'<{self.base_url}{link}>; rel="next"'
        return Response.json(page, headers=headers)

    def api_refs(self, req: Request) -> Response:
        repo = self._repo(req)
        branches = [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": s}
                    for n, s in repo.refs.items() if not n.startswith("refs/")]
        prs = [{"name": n, "ref": n, "targetCommit": s} for n, s in repo.refs.items() if n.startswith("refs/pr/")]
        return Response.json({"branches": branches, "converts": [], "tags": [],
                              **({"pullRequests": prs} if req.flag("include_prs") else {})})

    def api_preupload(self, req: Request) -> Response:
        repo = self._repo(req)
        commit = self._commit(repo, req.params["rev"])
        answers = []
        for f in req.json()["files"]:
            lfs = must_be_lfs(f["path"], f["size"], base64.b64decode(f.get("sample", "")))
            existing = commit.files.get(f["path"])
            answer = {"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False}
            if existing is not None:  # lets the client skip files that did not change
                answer["oid"] = existing.sha256 if existing.lfs else existing.git_oid
            answers.append(answer)
        return Response.json({"files": answers, "commitOid": commit.sha})

    def api_lfs_batch(self, req: Request) -> Response:
        repo = self._repo(req)
        data = req.json()
        if data.get("operation") != "upload":
            raise HubError(400, "this test hub only supports LFS uploads")
        objects = []
        for obj in data["objects"]:
            oid, size = obj["oid"], obj["size"]
            if oid in repo.lfs_objects:  # already here: no actions, the client skips it
                objects.append({"oid": oid, "size": size})
                continue
            objects.append({"oid": oid, "size": size, "authenticated": True, "actions": {
                "upload": {"href": f"{self.base_url}/lfs-upload/{repo.repo_id}/{oid}?size={size}"},
                "verify": {"href": f"{self.base_url}/{repo.repo_id}.git/info/lfs/objects/verify"},
            }})
        return Response.json({"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
                             headers={"Content-Type": "application/vnd.git-lfs+json"})

    def api_lfs_put(self, req: Request) -> Response:
        repo = self.repos.get(req.params["repo"])
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        if self.fail_lfs_after is not None and self.lfs_puts_ok >= self.fail_lfs_after:
            raise HubError(400, "simulated failure: the upload was interrupted (fail_lfs_uploads_after)")
        oid = req.params["oid"]
        if hashlib.sha256(req.body).hexdigest() != oid:
            raise HubError(400, f"uploaded content does not match sha256 {oid}")
        repo.lfs_objects[oid] = req.body
        self.lfs_puts_ok += 1
        return Response()

    def api_lfs_verify(self, req: Request) -> Response:
        repo = self._repo(req)
        obj = req.json()
        data = repo.lfs_objects.get(obj["oid"])
        if data is None or len(data) != obj["size"]:
            raise HubError(404, f"LFS object {obj['oid']} was not uploaded")
        return Response.json({"success": True})

    def api_commit(self, req: Request) -> Response:
        repo = self._repo(req)
        rev = req.params["rev"]
        lines = [json.loads(line) for line in req.body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "the commit payload must start with a header line")
        header = lines[0]["value"]
        base = self._commit(repo, rev)
        if req.flag("create_pr"):
            branch = f"refs/pr/{repo.next_pr}"
        elif rev.removeprefix("refs/heads/") in repo.refs:
            branch = rev.removeprefix("refs/heads/")
        else:
            raise HubError(400, f"Invalid rev id: {rev} is not a branch (create one first)")
        if header.get("parentCommit") and header["parentCommit"] != base.sha:
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(base.files)
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            path = value.get("path", "")
            if key == "file":
                data = base64.b64decode(value["content"]) if value.get("encoding") == "base64" else value["content"].encode()
                if len(data) >= LFS_SIZE_THRESHOLD:
                    raise HubError(400, f"Your push was rejected: {path} is larger than 10 MiB, upload it with LFS")
                files[path] = Blob.make(data, lfs=False)
            elif key == "lfsFile":
                data = repo.lfs_objects.get(value["oid"])
                if data is None or ("size" in value and len(data) != value["size"]):
                    raise HubError(422, f"LFS object {value['oid']} for {path} was not uploaded")
                files[path] = Blob.make(data, lfs=True)
            elif key == "deletedFile":
                if files.pop(path, None) is None:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
            elif key == "deletedFolder":
                inside = [p for p in files if p.startswith(path.rstrip("/") + "/")]
                if not inside:
                    raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                for p in inside:
                    del files[p]
            else:
                raise HubError(400, f"unsupported commit operation: {key}")
        commit = self._new_commit(repo, base, files, header.get("summary", ""))
        repo.refs[branch] = commit.sha
        pr_url = None
        if req.flag("create_pr"):
            pr_url = f"{self.base_url}/{repo.repo_id}/discussions/{repo.next_pr}"
            repo.next_pr += 1
        return Response.json({"success": True, "commitOid": commit.sha, "pullRequestUrl": pr_url,
                              "commitUrl": f"{self.base_url}/{repo.repo_id}/commit/{commit.sha}"})

    def api_branch(self, req: Request) -> Response:
        repo = self._repo(req)
        branch = req.params["branch"]
        if req.method == "DELETE":
            if branch == "main" or branch not in repo.refs:
                raise HubError(403 if branch == "main" else 404, f"cannot delete branch {branch}")
            del repo.refs[branch]
            return Response.json({})
        if branch.startswith("refs/") or branch in repo.refs:
            raise HubError(409, f"Reference already exists: {branch}")
        start = (req.json() or {}).get("startingPoint") or "main"
        repo.refs[branch] = self._commit(repo, start).sha
        return Response.json({})

    def api_resolve(self, req: Request) -> Response:
        repo = self._repo(req, files=True)
        commit = self._commit(repo, req.params["rev"])
        headers = {"X-Repo-Commit": commit.sha}
        blob = commit.files.get(req.params["path"])
        if blob is None:
            raise HubError(404, "Entry not found", "EntryNotFound", headers)
        headers.update({"ETag": f'"{blob.etag}"', "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"})
        if blob.lfs:
            headers.update({"X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(len(blob.data))})
        data, status = blob.data, 200
        ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", req.headers.get("range", ""))
        if ranged and req.method == "GET":
            start = int(ranged[1])
            end = min(int(ranged[2]) if ranged[2] else len(data) - 1, len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start:end + 1], 206
        return Response(status, data, headers)


# ----------------------------------------------------------------------------------------------------------------------
# HTTP plumbing
# ----------------------------------------------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def do_GET(self):
        self._serve()

    do_HEAD = do_POST = do_PUT = do_DELETE = do_GET

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def setup(self):
        super().setup()
        with self.server.lock:
            self.server.connections.add(self.connection)

    def finish(self):
        super().finish()
        with self.server.lock:
            self.server.connections.discard(self.connection)

    def _serve(self):
        body = self._read_body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        response = self.server.hub.handle(self.command, self.path, headers, body)
        self.send_response(response.status)
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    def log_message(self, format, *args):  # quiet; the Hub object keeps a token-free request log
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: Hub

    def __init__(self, address):
        super().__init__(address, _Handler)
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()  # open keep-alive connections, closed on shutdown

    def close_connections(self):
        with self.lock:
            for conn in self.connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


# ----------------------------------------------------------------------------------------------------------------------
# Pointing huggingface_hub / transformers at a server
# ----------------------------------------------------------------------------------------------------------------------
def configure_hf_client(monkeypatch, endpoint: str, hf_home: str | os.PathLike, token: str | None = FAKE_TOKEN) -> dict:
    """Point huggingface_hub (already imported or not) and transformers at `endpoint`, for one test.

    huggingface_hub copies HF_* environment variables into `huggingface_hub.constants` at import time, its
    module-level `HfApi()` (behind `hf_api.model_info`, `create_repo`, ... that transformers imports) keeps the
    endpoint it was created with, and transformers caches an `HfApi` too. So besides the environment (for
    subprocesses and for modules not imported yet) this patches those copies; monkeypatch undoes it all.
    Returns the HF_* variables set, for subprocess environments.
    """
    hf_home = Path(hf_home)
    env = {
        "HF_ENDPOINT": endpoint, "HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_MODULES_CACHE": str(hf_home / "modules"), "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "0",
    }
    if token is not None:
        env["HF_TOKEN"] = token
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_ENABLE_HF_TRANSFER",
                 "HUGGINGFACE_CO_STAGING", "HF_ASSETS_CACHE", "HF_XET_CACHE", "HUGGINGFACE_HUB_CACHE"] + (
                     ["HF_TOKEN"] if token is None else []):
        monkeypatch.delenv(name, raising=False)

    if "huggingface_hub" in sys.modules:
        from huggingface_hub import constants, hf_api

        patches = {
            "ENDPOINT": endpoint.rstrip("/"),
            "HUGGINGFACE_CO_URL_TEMPLATE": endpoint.rstrip("/") + "/{repo_id}/resolve/{revision}/{filename}",
            "HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"),
            "HUGGINGFACE_HUB_CACHE": str(hf_home / "hub"), "HF_ASSETS_CACHE": str(hf_home / "assets"),
            "HF_XET_CACHE": str(hf_home / "xet"), "HF_TOKEN_PATH": str(hf_home / "token"),
            "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens"),
            "HF_HUB_OFFLINE": False, "HF_HUB_DISABLE_XET": True, "HF_HUB_DISABLE_TELEMETRY": True,
            "HF_HUB_DISABLE_IMPLICIT_TOKEN": False,
        }
        if hasattr(constants, "HF_URL_HOSTS"):  # 2.x: hosts whose redirects keep the auth header
            patches["HF_URL_HOSTS"] = frozenset(constants.HF_URL_HOSTS | {urlsplit(endpoint).hostname})
        for name, value in patches.items():
            if hasattr(constants, name):
                monkeypatch.setattr(constants, name, value)
        if isinstance(getattr(hf_api, "api", None), hf_api.HfApi):
            monkeypatch.setattr(hf_api.api, "endpoint", endpoint.rstrip("/"))
        hf_tqdm = sys.modules.get("huggingface_hub.utils.tqdm")
        if hf_tqdm is not None and hasattr(hf_tqdm, "HF_HUB_DISABLE_PROGRESS_BARS"):
            monkeypatch.setattr(hf_tqdm, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    if "transformers.utils.hub" in sys.modules:
        thub = sys.modules["transformers.utils.hub"]
        if hasattr(thub, "_hf_api"):
            monkeypatch.setattr(thub, "_hf_api", None)  # re-created lazily with the patched endpoint
        # HF_MODULES_CACHE is also copied at import, into several modules: remote code needs a subprocess.
    return env


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (for 'Hub unreachable' tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class HubServer:
    """A running test Hub. `hub` is the state (repos, request log); the rest are test helpers."""

    def __init__(self):
        self._server = _Server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self.hub = self._server.hub = Hub(self.url)
        self.token = FAKE_TOKEN
        self.env: dict[str, str] = {}  # HF_* variables of the client side (set by the fixture)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="test-hub", daemon=True)
        self._thread.start()

    def close(self):
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()

    # -- seeding and inspecting ------------------------------------------------------------------------------------
    def create_repo_with_files(self, repo_id: str, files: dict[str, bytes | str | os.PathLike], *,
                               gated: bool = False, private: bool = False, branch: str = "main") -> str:
        """Create `repo_id` (if needed) and commit `files` to `branch` as one commit. `files` maps a path in
        the repo to its content: bytes, str (text) or a pathlib.Path to read. Returns the commit sha."""
        with self.hub._lock:
            repo = self.hub.repos.get(repo_id) or self.hub.add_repo(repo_id, private=private, gated=gated)
            repo.gated, repo.private = gated, private
            base = repo.resolve(branch) or repo.resolve("main")
            tree = dict(base.files)
            for path, content in files.items():
                data = Path(content).read_bytes() if isinstance(content, os.PathLike) else (
                    content.encode() if isinstance(content, str) else content)
                lfs = must_be_lfs(path, len(data), data[:512])
                if lfs:
                    repo.lfs_objects[hashlib.sha256(data).hexdigest()] = data
                tree[path] = Blob.make(data, lfs)
            commit = self.hub._new_commit(repo, base, tree, "seed files")
            repo.refs[branch] = commit.sha
            return commit.sha

    def create_repo_from_folder(self, repo_id: str, folder: str | os.PathLike, **kwargs) -> str:
        folder = Path(folder)
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.create_repo_with_files(repo_id, files, **kwargs)

    def files(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        """{path: content} of `repo_id` at `rev` (a branch, "refs/pr/N" or a commit sha), .gitattributes included."""
        with self.hub._lock:
            commit = self.hub.repos[repo_id].resolve(rev)
            if commit is None:
                raise KeyError(f"{repo_id} has no revision {rev!r}")
            return {path: blob.data for path, blob in commit.files.items()}

    def refs(self, repo_id: str) -> dict[str, str]:
        with self.hub._lock:
            return dict(self.hub.repos[repo_id].refs)

    def commits(self, repo_id: str) -> list[Commit]:
        with self.hub._lock:
            return list(self.hub.repos[repo_id].commits.values())

    def lfs_objects(self, repo_id: str) -> dict[str, bytes]:
        with self.hub._lock:
            return dict(self.hub.repos[repo_id].lfs_objects)

    # -- request log -----------------------------------------------------------------------------------------------
    @property
    def request_log(self) -> list[LoggedRequest]:
        with self.hub._lock:
            return list(self.hub.request_log)

    def clear_log(self):
        with self.hub._lock:
            self.hub.request_log.clear()

    def lfs_uploads(self) -> list[str]:
        """sha256 of every LFS object whose PUT succeeded, in order."""
        return [r.path.rsplit("/", 1)[1] for r in self.request_log
                if r.method == "PUT" and r.path.startswith("/lfs-upload/") and r.status == 200]

    def downloads(self, repo_id: str | None = None) -> list[str]:
        """Paths of files served by GET .../resolve/... (successful), optionally for one repo."""
        out = []
        for r in self.request_log:
            m = re.fullmatch(r"/((?:[^/]+/)?[^/]+)/resolve/([^/]+)/(.+)", r.raw_path)
            if r.method == "GET" and m and r.status in (200, 206) and repo_id in (None, unquote(m[1])):
                out.append(unquote(m[3]))
        return out

    # -- failure injection -----------------------------------------------------------------------------------------
    def fail_lfs_uploads_after(self, n: int | None):
        """Let `n` more LFS PUTs succeed, then answer every further one with an error (400, not retried by
        the client), as if the connection dropped. `None` turns it off."""
        with self.hub._lock:
            self.hub.fail_lfs_after, self.hub.lfs_puts_ok = n, 0

    # -- running client code in a fresh interpreter ----------------------------------------------------------------
    def subprocess_env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()}
        env.update(self.env)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = checkout_env()["PYTHONPATH"]
        env.update(extra)
        return env

    def run_python(self, code: str, *, timeout: float = 300, check: bool = True, cwd: str | os.PathLike | None = None,
                   **extra_env: str) -> subprocess.CompletedProcess:
        """Run `code` in a new interpreter whose environment points at this server (HF_ENDPOINT, HF_HOME,
        HF_MODULES_CACHE, HF_TOKEN...), e.g. to load with transformers / trust_remote_code. `cwd` defaults to an
        empty folder so that no local folder shadows a repo id. With `check`, a non-zero exit raises
        AssertionError showing the output's tail."""
        if cwd is None:
            cwd = Path(self.env["HF_HOME"]) / "cwd" if "HF_HOME" in self.env else REPO_ROOT
            cwd.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=self.subprocess_env(**extra_env),
                              cwd=cwd, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        return proc


try:
    import pytest
except ImportError:  # the server itself needs only the standard library
    pytest = None

if pytest is not None:

    @pytest.fixture
    def hub_server(monkeypatch, tmp_path_factory):
        """A fresh test Hub on a free 127.0.0.1 port; huggingface_hub/transformers point at it (HF_ENDPOINT,
        a private HF_HOME, a fake HF_TOKEN, Xet and telemetry off) for the duration of the test."""
        server = HubServer()
        hf_home = tmp_path_factory.mktemp("hf_home")
        server.env = configure_hf_client(monkeypatch, server.url, hf_home, token=server.token)
        try:
            yield server
        finally:
            server.close()


if __name__ == "__main__":
    srv = HubServer()
    print(f"test hub on {srv.url}; token {FAKE_TOKEN}; Ctrl-C to stop", flush=True)
    try:
        srv._thread.join()
    except KeyboardInterrupt:
        srv.close()
