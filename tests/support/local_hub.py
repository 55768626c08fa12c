"""A local Hugging Face Hub server: TEST INFRASTRUCTURE, not part of the package.

No public package offers a Hub that accepts uploads offline, so the tests run this small HTTP
server, which implements the subset of the Hub API that the real ``huggingface_hub`` client (and
through it ``transformers``) uses to publish and load a model repo:

=========================================================  ==========================================
``POST /api/repos/create``                                 create a model repo (409 if it exists)
``POST /api/validate-yaml``                                README metadata check before a commit
``GET  /api/whoami-v2``                                    the token's user
``GET  /api/models/{repo}[/revision/{rev}]``               model info: sha, siblings, card metadata
``GET  /api/models/{repo}/tree/{rev}[/{path}]``            file listing (``recursive``), LFS info
``POST /api/models/{repo}/preupload/{rev}``                upload mode per file (regular / lfs)
``POST /{repo}.git/info/lfs/objects/batch``                LFS batch: basic transfer actions
``PUT  /lfs/{oid}`` + ``POST /lfs/{oid}/verify``           LFS object upload (sha256 checked) + verify,
                                                           on a second port: the object store
``POST /api/models/{repo}/commit/{rev}``                   ndjson commit: file / lfsFile / deletions
``POST /api/models/{repo}/branch/{branch}``                create a branch from ``main``
``GET|HEAD /{repo}/resolve/{rev}/{path}``                  file download: ETag, X-Repo-Commit; LFS
                                                           files redirect to the object store's
                                                           ``/lfs/{oid}`` with X-Linked-Etag /
                                                           X-Linked-Size, as the Hub redirects to
                                                           its CDN (another origin, so the client
                                                           reads the metadata from the redirect)
=========================================================  ==========================================

Errors follow the Hub: an unknown repo (or a private one without its owner's token) answers 401
with ``X-Error-Code: RepoNotFound``, an unknown revision 404 ``RevisionNotFound``, a missing file
404 ``EntryNotFound`` (with ``X-Repo-Commit``, which the client caches as "does not exist"),
writes without a valid token 401.  Every commit gets a 40-hex id; branches point at commits, so
``revision`` may be a branch or a commit id.  Requests the server does not implement answer 501
and are recorded in ``LocalHub.unhandled`` so tests can assert the client needed nothing else.

Use::

    with LocalHub(tokens={"hf_test": "polar-user"}) as hub:
        env = hub.client_env(hf_home)  # HF_ENDPOINT, HF_TOKEN, HF_HOME, HF_HUB_DISABLE_XET=1, online
        subprocess.run([...], env=env)

or by hand: ``python tests/support/local_hub.py --port 8999 --token hf_test:polar-user``.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

import yaml

GITATTRIBUTES = (
    "\n".join(
        f"{pattern} filter=lfs diff=lfs merge=lfs -text"
        for pattern in (
            "*.bin",
            "*.ckpt",
            "*.h5",
            "*.msgpack",
            "*.npy",
            "*.npz",
            "*.onnx",
            "*.pkl",
            "*.pt",
            "*.pth",
            "*.safetensors",
            "*.tar.gz",
            "*.zip",
            "*tfevents*",
        )
    )
    + "\n"
)
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024  # the Hub stores files from 10 MiB in LFS
TEST_USER, TEST_TOKEN = "polar-user", "hf_local_test_token"  # the user the test suite's hub knows


def git_blob_oid(content: bytes) -> str:
    """``git hash-object``: sha1 of ``b"blob <size>\\0" + content``."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class StoredFile:
    """A file of a commit: regular content inline, LFS content by sha256 in ``LocalHub.lfs``."""

    size: int
    content: bytes | None = None
    sha256: str | None = None

    @property
    def blob_oid(self) -> str:
        return git_blob_oid(self.content if self.sha256 is None else lfs_pointer(self.sha256, self.size))

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_oid


@dataclass
class Commit:
    oid: str
    title: str
    date: str
    files: dict[str, StoredFile]


@dataclass
class Repo:
    repo_id: str
    private: bool
    created_at: str
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        oid = self.branches.get(revision, revision)
        return self.commits.get(oid)


class HubError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        commit: str | None = None,
        payload: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.commit = status, message, code, commit
        self.payload = payload or {}


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


def card_metadata(readme: bytes | None) -> dict:
    """The YAML block at the top of README.md, as the Hub reads it into ``cardData``."""
    if not readme:
        return {}
    text = readme.decode("utf-8", errors="replace")
    if not text.startswith("---"):
        return {}
    block = text[3:].split("\n---", 1)[0]
    loaded = yaml.safe_load(block)
    if not isinstance(loaded, dict):
        raise HubError(400, "README.md metadata must be a YAML mapping")
    return loaded


class LocalHub:
    """In-memory Hub state, served on ``127.0.0.1`` by two threaded HTTP servers on free ports:
    the Hub API (``endpoint``) and the LFS object store (``storage``)."""

    def __init__(self, tokens: dict[str, str] | None = None, port: int = 0):
        self.tokens = dict(tokens or {})  # token -> user name
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.lock = threading.RLock()
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        self.servers = [ThreadingHTTPServer(("127.0.0.1", p), _handler_for(self)) for p in (port, 0)]
        self.endpoint, self.storage = (f"http://127.0.0.1:{s.server_address[1]}" for s in self.servers)

    def __enter__(self) -> LocalHub:
        for server in self.servers:
            threading.Thread(target=server.serve_forever, name="local-hub", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()

    def client_env(self, hf_home: str | os.PathLike, token: str | None = None) -> dict[str, str]:
        """Environment for a client subprocess: this endpoint, a fresh cache, online, no Xet."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TOKEN")
        }
        env.update(
            HF_ENDPOINT=self.endpoint,
            HF_HOME=str(hf_home),
            HF_HUB_DISABLE_XET="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_ETAG_TIMEOUT="30",
            HF_HUB_DOWNLOAD_TIMEOUT="60",
        )
        if token is not None:
            env["HF_TOKEN"] = token
        return env

    # -- state ---------------------------------------------------------------------------------

    def user(self, authorization: str | None) -> str | None:
        """The user behind ``Authorization: Bearer <token>``; 401 for an unknown token."""
        if not authorization:
            return None
        token = authorization.removeprefix("Bearer ").strip()
        if token not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        return self.tokens[token]

    def repo(self, repo_id: str, user: str | None, write: bool = False) -> Repo:
        repo = self.repos.get(repo_id)
        owner = repo_id.split("/")[0]
        if repo is None or (repo.private and user != owner):
            raise HubError(401, f"Repository Not Found for {repo_id}", "RepoNotFound")
        if write and user != owner:
            raise HubError(403, f"You don't have the rights to write to {repo_id}")
        return repo

    def commit(
        self, repo: Repo, branch: str, title: str, files: dict[str, StoredFile], parent: str | None = None
    ) -> Commit:
        head = repo.branches.get(branch)
        if head is None:
            raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        if parent is not None and parent != head:
            raise HubError(412, f"A commit has happened since {parent}; the branch head is now {head}")
        date = now()
        digest = hashlib.sha1(
            json.dumps(
                [repo.repo_id, head, title, date, len(repo.commits), sorted((p, f.etag) for p, f in files.items())]
            ).encode()
        )
        commit = Commit(digest.hexdigest(), title, date, files)
        repo.commits[commit.oid] = commit
        repo.branches[branch] = commit.oid
        return commit

    def create_repo(self, name: str, organization: str | None, private: bool, user: str | None) -> Repo:
        if user is None:
            raise HubError(401, "You must be authenticated to create a repo")
        namespace = organization or user
        if namespace != user:
            raise HubError(403, f"You don't have the rights to create a repo under {namespace}")
        repo_id = f"{namespace}/{name}"
        if repo_id in self.repos:
            raise HubError(409, "You already created this model repo", payload={"url": f"{self.endpoint}/{repo_id}"})
        repo = Repo(repo_id, private, now())
        self.repos[repo_id] = repo
        initial = Commit(
            hashlib.sha1(f"{repo_id} initial {repo.created_at}".encode()).hexdigest(),
            "initial commit",
            repo.created_at,
            {".gitattributes": StoredFile(len(GITATTRIBUTES), GITATTRIBUTES.encode())},
        )
        repo.commits[initial.oid] = initial
        repo.branches["main"] = initial.oid
        return repo

    def upload_mode(self, commit: Commit, path: str, size: int, sample: bytes) -> str:
        """``lfs`` for paths the repo's .gitattributes sends to LFS, large files and binary samples."""
        attributes = commit.files.get(".gitattributes")
        patterns = [
            line.split()[0]
            for line in (attributes.content.decode() if attributes else "").splitlines()
            if "filter=lfs" in line
        ]
        name = path.rsplit("/", 1)[-1]
        matches = any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(path, p) for p in patterns)
        return "lfs" if matches or size >= LFS_SIZE_THRESHOLD or b"\0" in sample else "regular"

    def model_info(self, repo: Repo, commit: Commit, blobs: bool) -> dict:
        card = card_metadata(commit.files["README.md"].content if "README.md" in commit.files else None)
        config = commit.files.get("config.json")
        siblings = []
        for path, stored in sorted(commit.files.items()):
            sibling = {"rfilename": path}
            if blobs:
                sibling.update(size=stored.size, blobId=stored.blob_oid)
                if stored.sha256:
                    sibling["lfs"] = {
                        "sha256": stored.sha256,
                        "size": stored.size,
                        "pointerSize": len(lfs_pointer(stored.sha256, stored.size)),
                    }
            siblings.append(sibling)
        return {
            "_id": repo.repo_id,
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": commit.oid,
            "lastModified": commit.date,
            "createdAt": repo.created_at,
            "private": repo.private,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "library_name": card.get("library_name"),
            "pipeline_tag": card.get("pipeline_tag"),
            "tags": list(card.get("tags") or []),
            "cardData": card or None,
            "config": json.loads(config.content) if config is not None else None,
            "siblings": siblings,
        }

    def tree(self, commit: Commit, prefix: str, recursive: bool) -> list[dict]:
        prefix = prefix.strip("/")
        entries: dict[str, dict] = {}
        for path, stored in sorted(commit.files.items()):
            if prefix and not path.startswith(prefix + "/"):
                continue
            rest = path[len(prefix) + 1 :] if prefix else path
            parts = rest.split("/")
            for depth in range(1, len(parts)):
                folder = "/".join(([prefix] if prefix else []) + parts[:depth])
                if recursive or depth == 1:
                    entries.setdefault(
                        folder,
                        {
                            "type": "directory",
                            "path": folder,
                            "oid": hashlib.sha1(folder.encode()).hexdigest(),
                            "size": 0,
                        },
                    )
            if recursive or len(parts) == 1:
                entry = {"type": "file", "path": path, "size": stored.size, "oid": stored.blob_oid}
                if stored.sha256:
                    entry["lfs"] = {
                        "oid": stored.sha256,
                        "size": stored.size,
                        "pointerSize": len(lfs_pointer(stored.sha256, stored.size)),
                    }
                entries[path] = entry
        if prefix and not entries:
            raise HubError(404, f"Entry not found: {prefix}", "EntryNotFound", commit.oid)
        return [entries[k] for k in sorted(entries)]

    def apply_commit(self, repo: Repo, branch: str, lines: list[dict]) -> Commit:
        head = repo.resolve(branch)
        if head is None:
            raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        header = next((line["value"] for line in lines if line.get("key") == "header"), None)
        if header is None or not header.get("summary"):
            raise HubError(400, "A commit needs a header line with a summary")
        files = dict(head.files)
        for line in lines:
            key, value = line.get("key"), line.get("value", {})
            if key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, f"unsupported encoding {value.get('encoding')!r}")
                content = base64.b64decode(value["content"])
                files[value["path"]] = StoredFile(len(content), content)
            elif key == "lfsFile":
                oid = value["oid"]
                if oid not in self.lfs:
                    raise HubError(422, f"LFS object {oid} for {value['path']} was never uploaded")
                files[value["path"]] = StoredFile(len(self.lfs[oid]), sha256=oid)
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    raise HubError(404, f"A file with this name doesn't exist: {value['path']}", "EntryNotFound")
            elif key == "deletedFolder":
                folder = value["path"].rstrip("/") + "/"
                for path in [p for p in files if p.startswith(folder)]:
                    del files[path]
            elif key != "header":
                raise HubError(400, f"unknown commit operation {key!r}")
        title = header["summary"]
        return self.commit(repo, branch, title, files, header.get("parentCommit"))


def _handler_for(hub: LocalHub) -> type[BaseHTTPRequestHandler]:
    class Handler(_HubRequestHandler):
        pass

    Handler.hub = hub
    return Handler


class _HubRequestHandler(BaseHTTPRequestHandler):
    """Routes one request to the ``LocalHub`` state; every answer has a Content-Length."""

    hub: LocalHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # quiet: tests read hub.requests instead
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    # -- plumbing ------------------------------------------------------------------------------

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _json_body(self) -> dict:
        try:
            return json.loads(self.body or b"{}")
        except json.JSONDecodeError as error:
            raise HubError(400, f"invalid JSON body: {error}") from error

    def _send(
        self,
        status: int,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, payload, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), headers)

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = url.path.strip("/").split("/")  # still quoted: a revision may contain %2F
        self.hub.requests.append((method, self.path))
        self.body = self._read_body()  # read first: an error answer must not leave it on the connection
        try:
            with self.hub.lock:
                user = self.hub.user(self.headers.get("Authorization"))
                if not self._route(method, parts, user):
                    self.hub.unhandled.append((method, self.path))
                    raise HubError(501, f"the local test Hub does not implement {method} {url.path}")
        except (KeyError, TypeError, ValueError) as error:  # a malformed request, answered like the Hub
            self._send_json({"error": f"bad request: {error!r}"}, 400, {"X-Error-Message": repr(error)})
        except HubError as error:
            headers = {"X-Error-Message": " ".join(error.message.split())}
            if error.code:
                headers["X-Error-Code"] = error.code
            if error.commit:
                headers["X-Repo-Commit"] = error.commit
            self._send_json({"error": error.message, **error.payload}, error.status, headers)

    def _route(self, method: str, parts: list[str], user: str | None) -> bool:
        hub = self.hub
        if parts[:1] == ["api"]:
            return self._route_api(method, parts[1:], user)
        if parts[:1] == ["lfs"] and len(parts) >= 2:
            return self._route_lfs(method, parts[1:])
        if (
            method == "POST"
            and len(parts) == 6
            and parts[1].endswith(".git")
            and parts[2:] == ["info", "lfs", "objects", "batch"]
        ):
            repo = hub.repo(f"{parts[0]}/{parts[1][:-4]}", user, write=True)
            self._lfs_batch(repo)
            return True
        if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
            repo = hub.repo(f"{parts[0]}/{parts[1]}", user)
            self._resolve(repo, unquote(parts[3]), unquote("/".join(parts[4:])))
            return True
        return False

    def _route_api(self, method: str, parts: list[str], user: str | None) -> bool:
        hub = self.hub
        if method == "POST" and parts == ["repos", "create"]:
            body = self._json_body()
            if body.get("type", "model") != "model":
                raise HubError(400, "the local test Hub stores model repos only")
            private = body.get("visibility", "private" if body.get("private") else "public") != "public"
            repo = hub.create_repo(body["name"], body.get("organization"), private, user)
            self._send_json({"url": f"{hub.endpoint}/{repo.repo_id}", "name": repo.repo_id, "id": repo.repo_id})
            return True
        if method == "POST" and parts == ["validate-yaml"]:
            try:
                card_metadata(self._json_body().get("content", "").encode())
            except (yaml.YAMLError, HubError) as error:
                self._send_json({"errors": [{"message": str(error)}], "warnings": []}, 400)
                return True
            self._send_json({"errors": [], "warnings": []})
            return True
        if method == "GET" and parts == ["whoami-v2"]:
            if user is None:
                raise HubError(401, "Invalid credentials in Authorization header")
            self._send_json(
                {
                    "type": "user",
                    "name": user,
                    "fullname": user,
                    "orgs": [],
                    "auth": {"type": "access_token", "accessToken": {"role": "write"}},
                }
            )
            return True
        if len(parts) < 3 or parts[0] != "models":
            return False
        repo_id, rest = f"{parts[1]}/{parts[2]}", parts[3:]
        if method == "GET" and (not rest or rest[0] == "revision"):
            repo = hub.repo(repo_id, user)
            revision = unquote(rest[1]) if len(rest) >= 2 else "main"
            commit = self._commit_or_404(repo, revision)
            self._send_json(hub.model_info(repo, commit, self.query.get("blobs") in ("True", "true", "1")))
            return True
        if method == "GET" and rest[:1] == ["tree"] and len(rest) >= 2:
            repo = hub.repo(repo_id, user)
            commit = self._commit_or_404(repo, unquote(rest[1]))
            recursive = self.query.get("recursive") in ("True", "true", "1")
            self._send_json(hub.tree(commit, unquote("/".join(rest[2:])), recursive))
            return True
        if method == "POST" and rest[:1] in (["preupload"], ["commit"], ["branch"]) and len(rest) == 2:
            repo = hub.repo(repo_id, user, write=True)
            if self.query.get("create_pr"):
                raise HubError(400, "pull requests are not implemented in the local test Hub")
            revision = unquote(rest[1])
            if rest[0] == "preupload":
                self._preupload(repo, revision)
            elif rest[0] == "commit":
                self._commit(repo, revision)
            else:
                self._create_branch(repo, revision)
            return True
        return False

    def _route_lfs(self, method: str, parts: list[str]) -> bool:
        oid = parts[0]
        if method == "PUT" and len(parts) == 1:
            content = self.body
            if hashlib.sha256(content).hexdigest() != oid:
                raise HubError(400, f"uploaded content does not hash to {oid}")
            self.hub.lfs[oid] = content
            self._send(200)
            return True
        if method == "POST" and parts[1:] == ["verify"]:
            body = self._json_body()
            stored = self.hub.lfs.get(oid)
            if stored is None or len(stored) != body.get("size"):
                raise HubError(404, f"LFS object {oid} is missing or has the wrong size")
            self._send_json({"success": True})
            return True
        if method in ("GET", "HEAD") and len(parts) == 1:
            if oid not in self.hub.lfs:
                raise HubError(404, f"LFS object {oid} not found")
            self._send_content(self.hub.lfs[oid], {"ETag": f'"{oid}"'})
            return True
        return False

    # -- endpoints -----------------------------------------------------------------------------

    def _commit_or_404(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def _preupload(self, repo: Repo, revision: str) -> None:
        commit = self._commit_or_404(repo, revision)
        answers = []
        for item in self._json_body().get("files", []):
            mode = self.hub.upload_mode(commit, item["path"], int(item["size"]), base64.b64decode(item["sample"]))
            existing = commit.files.get(item["path"])
            oid = None if existing is None else (existing.sha256 or existing.blob_oid)
            answers.append({"path": item["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        self._send_json({"files": answers, "commitOid": commit.oid})

    def _lfs_batch(self, repo: Repo) -> None:
        body = self._json_body()
        if body.get("operation") != "upload" or "basic" not in body.get("transfers", ["basic"]):
            raise HubError(400, "the local test Hub supports LFS uploads with the basic transfer only")
        objects = []
        for item in body.get("objects", []):
            oid, size = item["oid"], int(item["size"])
            entry = {"oid": oid, "size": size, "authenticated": True}
            if oid not in self.hub.lfs:
                entry["actions"] = {
                    "upload": {"href": f"{self.hub.storage}/lfs/{oid}", "header": {}},
                    "verify": {"href": f"{self.hub.storage}/lfs/{oid}/verify", "header": {}},
                }
            objects.append(entry)
        self._send_json(
            {"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
            headers={"Content-Type": "application/vnd.git-lfs+json"},
        )

    def _commit(self, repo: Repo, revision: str) -> None:
        try:
            lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise HubError(400, f"invalid ndjson commit payload: {error}") from error
        commit = self.hub.apply_commit(repo, revision, lines)
        self._send_json(
            {
                "success": True,
                "commitOid": commit.oid,
                "pullRequestUrl": None,
                "commitUrl": f"{self.hub.endpoint}/{repo.repo_id}/commit/{commit.oid}",
            }
        )

    def _create_branch(self, repo: Repo, branch: str) -> None:
        start = self._json_body().get("startingPoint") or "main"
        if branch in repo.branches:
            raise HubError(409, f"Reference already exists: {branch}")
        repo.branches[branch] = self._commit_or_404(repo, start).oid
        self._send_json({"success": True})

    def _resolve(self, repo: Repo, revision: str, path: str) -> None:
        commit = self._commit_or_404(repo, revision)
        stored = commit.files.get(path)
        if stored is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", commit.oid)
        headers = {"X-Repo-Commit": commit.oid}
        if stored.sha256 is not None:  # LFS: redirect to the object store, like the Hub's CDN
            headers.update(
                {
                    "X-Linked-Etag": f'"{stored.sha256}"',
                    "X-Linked-Size": str(stored.size),
                    "ETag": f'"{stored.blob_oid}"',
                    "Location": f"{self.hub.storage}/lfs/{quote(stored.sha256)}",
                }
            )
            self._send(302, b"", headers)
            return
        headers["ETag"] = f'"{stored.blob_oid}"'
        self._send_content(stored.content, headers)

    def _send_content(self, content: bytes, headers: dict[str, str]) -> None:
        """200 with the whole content, or 206 for ``Range: bytes=N-`` (resumed downloads)."""
        requested = self.headers.get("Range", "")
        headers = {**headers, "Accept-Ranges": "bytes"}
        if requested.startswith("bytes=") and requested[6:].endswith("-") and requested[6:-1].isdigit():
            start = min(int(requested[6:-1]), len(content))
            headers["Content-Range"] = f"bytes {start}-{len(content) - 1}/{len(content)}"
            self._send(206, content[start:], headers, "application/octet-stream")
            return
        self._send(200, content, headers, "application/octet-stream")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Run the local test Hub (test infrastructure) in the foreground.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", action="append", default=[], metavar="TOKEN:USER")
    args = parser.parse_args()
    with LocalHub(dict(t.split(":", 1) for t in args.token), args.port) as hub:
        print(f"local test Hub at {hub.endpoint}  (HF_ENDPOINT={hub.endpoint} HF_HUB_DISABLE_XET=1)", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
