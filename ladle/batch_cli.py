"""`ladle batch`: submit a JSONL file as a batch and wait for its results, or look at one.

    ladle batch submit FILE.jsonl [-o OUT.jsonl]   upload, create, progress bar, download
    ladle batch status BATCH_ID                    the batch object (JSON)
    ladle batch cancel BATCH_ID                    cancel it (finished lines are kept)

Talks HTTP to a running Ladle (`--base-url`, default $LADLE_BASE_URL or
http://127.0.0.1:$LLM_PORT) with the standard library only; `--api-key` defaults to
$LADLE_API_KEY.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from shared.config import ClientSettings, get_settings

FINAL = ("completed", "failed", "expired", "cancelled")


class Client:
    """The few Files and Batches calls the command needs."""

    def __init__(self, base_url: str, api_key: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key

    def request(
        self, method: str, path: str, body: bytes | None = None, content_type: str | None = None
    ) -> bytes:
        headers = {"Content-Type": content_type} if content_type else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, body, headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=120) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise SystemExit(f"{method} {path}: {exc.code} {detail}") from None
        except urllib.error.URLError as exc:
            raise SystemExit(f"cannot reach {self.base_url}: {exc.reason}") from exc

    def json(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        return json.loads(self.request(method, path, data, "application/json" if data else None))

    def upload(self, path: Path) -> dict[str, Any]:
        """POST /v1/files as multipart/form-data (purpose=batch)."""
        boundary = uuid.uuid4().hex
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="{path.name}"\r\nContent-Type: application/jsonl\r\n\r\n'
        ).encode()
        body = head + path.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
        content_type = f"multipart/form-data; boundary={boundary}"
        return json.loads(self.request("POST", "/v1/files", body, content_type))


def progress_line(batch: dict[str, Any]) -> str:
    counts = batch["request_counts"]
    total, done = counts["total"], counts["completed"] + counts["failed"]
    width = 30
    filled = width * done // total if total else 0
    bar = "#" * filled + "." * (width - filled)
    return (
        f"\r[{bar}] {done}/{total} ({counts['completed']} ok, {counts['failed']} failed) "
        f"{batch['status']:<11}"
    )


def wait(client: Client, batch_id: str, poll_s: float) -> dict[str, Any]:
    while True:
        batch = client.json("GET", f"/v1/batches/{batch_id}")
        sys.stderr.write(progress_line(batch))
        sys.stderr.flush()
        if batch["status"] in FINAL:
            sys.stderr.write("\n")
            return batch
        time.sleep(poll_s)


def first_url(path: Path) -> str:
    with path.open("rb") as file:
        return json.loads(file.readline()).get("url", "/v1/chat/completions")


def submit(client: Client, args: argparse.Namespace) -> int:
    path = Path(args.file)
    uploaded = client.upload(path)
    body = {
        "input_file_id": uploaded["id"],
        "endpoint": args.endpoint or first_url(path),
        "completion_window": "24h",
    }
    batch = client.json("POST", "/v1/batches", body)
    print(f"batch {batch['id']} (input file {uploaded['id']})", file=sys.stderr)
    batch = wait(client, batch["id"], args.poll)
    output = Path(args.output or path.with_suffix(".output.jsonl"))
    for key, target in (("output_file_id", output), ("error_file_id", _errors_path(output))):
        if batch.get(key):
            target.write_bytes(client.request("GET", f"/v1/files/{batch[key]}/content"))
            print(f"{key.removesuffix('_file_id')} lines: {target}", file=sys.stderr)
    return 0 if batch["status"] == "completed" else 1


def _errors_path(output: Path) -> Path:
    name = output.name.removesuffix(".jsonl").removesuffix(".output")
    return output.with_name(name + ".errors.jsonl")


def add_parser(commands: argparse._SubParsersAction) -> None:
    batch = commands.add_parser(
        "batch",
        help="submit a JSONL batch and collect its results; status; cancel",
        description=__doc__.split("\n\n")[0],
    )
    client = ClientSettings()
    default_url = client.base_url or f"http://127.0.0.1:{get_settings().port}"
    batch.add_argument("--base-url", default=default_url, help=f"the API ({default_url})")
    batch.add_argument("--api-key", default=client.api_key)
    actions = batch.add_subparsers(dest="batch_command", required=True, metavar="ACTION")
    sub = actions.add_parser("submit", help="upload FILE, create the batch, wait, download")
    sub.add_argument("file", metavar="FILE.jsonl")
    sub.add_argument("-o", "--output", help="where output lines go (FILE.output.jsonl)")
    sub.add_argument("--endpoint", help="the batch's endpoint (default: the first line's url)")
    sub.add_argument("--poll", type=float, default=1.0, help="seconds between polls (1)")
    for name, text in (("status", "print the batch object"), ("cancel", "cancel the batch")):
        actions.add_parser(name, help=text).add_argument("batch_id", metavar="BATCH_ID")


def run(args: argparse.Namespace) -> int:
    client = Client(args.base_url, args.api_key)
    if args.batch_command == "submit":
        return submit(client, args)
    method, path = ("POST", f"/v1/batches/{args.batch_id}/cancel")
    if args.batch_command == "status":
        method, path = "GET", f"/v1/batches/{args.batch_id}"
    print(json.dumps(client.json(method, path), indent=2))
    return 0
