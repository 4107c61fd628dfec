#!/usr/bin/env python3
"""The hostile corpus of issue #26 against `prism serve`: 100+ malformed, oversized, unanswerable or
protocol-breaking requests, one at a time, each on its own connection, over loopback only.

Starts `prism serve` itself on a free port (the bundled demo model; --prism names the binary, --serve-args
adds flags), or talks to --url (which must be a loopback address). Bounded: every exchange has a 30 s
limit, the whole run stops after --deadline seconds, nothing is sent anywhere but 127.0.0.1 / ::1.

For every request it prints one line: its name, the status (or `-` when the server closed without an
answer, which only the cases marked so may do), the error type or `loc`, and the time. A request passes when
its status is one it may get and, for an error status, the body is the API's JSON error shape with an
`x-typesafe-request-id` header. After every tenth request and at the end, `/health` must answer 200 and a
reference request must answer the same bytes (before `x_latency_ms`) as at the start. The record (--json-out)
holds every request's result and the server's `/stats` at the end. Exit status 1 when anything failed.
"""

import argparse
import collections
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import zlib

REFERENCE = b'{"state": "The parcel arrived two days late.", "questions": {"late": {"type": "noul", "instructions": "Was it late?"}}}'
Q = '"questions": {"q": {"type": "noul", "instructions": "Is it?"}}'


def body(text):
    return text.encode() if isinstance(text, str) else text


def post(payload, headers=(), path="/v1/systemone", content_type="application/json", length=True):
    payload = body(payload)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    if content_type:
        head += f"Content-Type: {content_type}\r\n"
    for key, value in headers:
        head += f"{key}: {value}\r\n"
    if length:
        head += f"Content-Length: {len(payload)}\r\n"
    return head.encode() + b"\r\n" + payload


def raw(text):
    return body(text)


def json_cases():
    """Bodies the JSON layer and validation must refuse (or, for the few marked 200, answer)."""
    levels = lambda n: json.dumps([f"level {i}" for i in range(n)])
    options = lambda n: json.dumps([f"o{i}" for i in range(n)])
    question = lambda spec: f'{{"state": "s", "questions": {{"q": {spec}}}}}'
    with_field = lambda extra: f'{{"state": "s", {Q}, {extra}}}'
    cases = [
        ("truncated JSON", '{"state": "s", "questions": {', {422}),
        ("empty body", "", {422}),
        ("an array", "[1, 2, 3]", {422}),
        ("a bare string", '"hello"', {422}),
        ("null", "null", {422}),
        ("trailing garbage", f'{{"state": "s", {Q}}} x', {422}),
        ("invalid UTF-8", b'{"state": "\xff\xfe", "questions": {}}', {422}),
        ("a byte-order mark then JSON", b"\xef\xbb\xbf" + body(f'{{"state": "s", {Q}}}'), {200}),
        ("nesting 100,000 deep", '{"state": ' + "[" * 100_000 + "}", {422}),
        ("an integer of 5,000 digits", '{"state": ' + "9" * 5000 + f", {Q}}}", {422}),
        ("1e999999 (infinity, as in Python)", f'{{"state": 1e999999, {Q}}}', {200}),
        ("NaN evidence", f'{{"state": NaN, {Q}}}', {200}),
        ("lone surrogate in the state", f'{{"state": "a\\ud800", {Q}}}', {422}),
        ("lone low surrogate in instructions", question('{"type": "noul", "instructions": "\\udc00"}'), {422}),
        ("lone surrogate in a key", f'{{"state": {{"\\ud83d": 1}}, {Q}}}', {422}),
        ("control character in a string", b'{"state": "a\x01b", ' + body(Q) + b"}", {422}),
        ("invalid escape", f'{{"state": "\\q", {Q}}}', {422}),
        ("missing state", f"{{{Q}}}", {422}),
        ("missing questions", '{"state": "s"}', {422}),
        ("no questions", '{"state": "s", "questions": {}}', {422}),
        ("questions as a list", '{"state": "s", "questions": [1]}', {422}),
        ("question not an object", question("3"), {422}),
        ("unknown question type", question('{"type": "essay", "instructions": "x"}'), {422}),
        ("box question", question('{"type": "box", "instructions": "x"}'), {422}),
        ("blank instructions", question('{"type": "choice", "instructions": "  ", "criteria": ["a", "b"]}'), {422}),
        ("choice without criteria", question('{"type": "choice", "instructions": "x"}'), {422}),
        ("choice with one option", question('{"type": "choice", "instructions": "x", "criteria": ["a"]}'), {200, 422}),
        ("choice with duplicate options", question('{"type": "choice", "instructions": "x", "criteria": ["a", "a"]}'), {422}),
        ("choice with 27 options (wide)", question(f'{{"type": "choice", "instructions": "x", "criteria": {options(27)}}}'), {200}),
        ("choice with 2,000 options", question(f'{{"type": "choice", "instructions": "x", "criteria": {options(2000)}}}'), {200, 422}),
        ("score with 11 levels", question(f'{{"type": "score", "instructions": "x", "criteria": {levels(11)}}}'), {422}),
        ("score with 1 level", question(f'{{"type": "score", "instructions": "x", "criteria": {levels(1)}}}'), {422}),
        ("score criteria a number", question('{"type": "score", "instructions": "x", "criteria": 5}'), {422}),
        ("type not a string", question('{"type": 7, "instructions": "x"}'), {422}),
        ("instructions a number", question('{"type": "noul", "instructions": 12}'), {422}),
        ("empty question name", '{"state": "s", "questions": {"": {"type": "noul", "instructions": "x"}}}', {200, 422}),
        ("think_mode always", with_field('"think_mode": "always"'), {422}),
        ("think_mode nonsense", with_field('"think_mode": "sometimes"'), {422}),
        ("gate out of range", with_field('"gate": 7'), {422}),
        ("gate a string", with_field('"gate": "high"'), {422}),
        ("think_budget negative", with_field('"think_budget": -1'), {422}),
        ("return_details a string", with_field('"return_details": "yes"'), {422}),
        ("images given", with_field('"images": ["iVBORw0KGgo="]'), {422}),
        ("images not a list", with_field('"images": 3'), {422}),
        ("nine inline assets", with_field('"assets": {' + ", ".join(f'"a{i}": {{"format": "png", "data_base64": "iVBO"}}' for i in range(9)) + "}"), {422}),
        ("asset naming a part without multipart", with_field('"assets": {"a": {"part": "asset-0"}}'), {422}),
        ("unknown top-level field", with_field('"temperature": 0.5'), {200}),
        ("repeated key (the last wins, as in Python)", '{"state": 1, "state": "s", ' + Q + "}", {200}),
        ("129 questions (over --max-questions)", '{"state": "s", "questions": {' + ", ".join(f'"q{i}": {{"type": "noul", "instructions": "x"}}' for i in range(129)) + "}}", {422}),
        ("8 MB evidence (over --max-tokens by its length)", '{"state": "' + "word " * 1_600_000 + f'", {Q}}}', {422}),
        ("600 kB evidence, 128 questions (over --max-request-tokens)", '{"state": "' + "w" * 600_000 + '", "questions": {' + ", ".join(f'"q{i}": {{"type": "noul", "instructions": "x"}}' for i in range(128)) + "}}", {422}),
        ("a 40k-token evidence (over --max-tokens after tokenizing)", '{"state": "' + " ".join(f"w{i}" for i in range(20_000)) + f'", {Q}}}', {422}),
    ]
    return [(f"json: {name}", post(payload), statuses, False) for name, payload, statuses in cases]


def body_cases():
    """Content types, encodings, sizes and multipart framing."""
    valid = f'{{"state": "s", {Q}}}'
    boundary = "b0undary"
    part = lambda name, data: f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\nContent-Type: application/json\r\n\r\n{data}\r\n'
    multipart_type = f"multipart/form-data; boundary={boundary}"
    cases = [
        ("text/plain", post(valid, content_type="text/plain"), {415}),
        ("JSON in latin-1", post(valid, content_type="application/json; charset=latin-1"), {415}),
        ("no Content-Type (read as JSON)", post(valid, content_type=None), {200}),
        ("gzip Content-Encoding", post(zlib.compress(body(valid)), [("Content-Encoding", "gzip")]), {415}),
        ("zstd header over bytes that are not zstd", post(b"not zstd at all", [("Content-Encoding", "zstd")]), {400}),
        ("zstd frame asking for a 2 GiB window", post(bytes([0x28, 0xB5, 0x2F, 0xFD, 0x00, 21 << 3, 0, 0, 0]), [("Content-Encoding", "zstd")]), {400}),
        ("zstd, zstd", post(valid, [("Content-Encoding", "zstd, zstd")]), {415}),
        ("9 MB body (over the 8 MiB limit)", post(b"x" * 9_000_000), {413}),
        ("Content-Length of 9 MB declared, nothing sent", raw(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: 9000000\r\n\r\n"), {413}),
        ("multipart without a boundary", post(part("request", valid) + f"--{boundary}--\r\n", content_type="multipart/form-data"), {400}),
        ("multipart with the boundary missing from the body", post("no boundary here", content_type=multipart_type), {400}),
        ("multipart never closed", post(part("request", valid), content_type=multipart_type), {400}),
        ("multipart without a request part", post(part("other", valid) + f"--{boundary}--\r\n", content_type=multipart_type), {400}),
        ("multipart with two request parts", post(part("request", valid) + part("request", valid) + f"--{boundary}--\r\n", content_type=multipart_type), {400}),
        ("multipart with 70 parts", post("".join(part(f"p{i}", "x") for i in range(70)) + f"--{boundary}--\r\n", content_type=multipart_type), {400}),
        ("multipart with only the request (valid)", post(part("request", valid) + f"--{boundary}--\r\n", content_type=multipart_type), {200}),
    ]
    return [(f"body: {name}", request, statuses, False) for name, request, statuses in cases]


def protocol_cases():
    """Framing, request lines and headers: some answered by hyper itself (reshaped by the server)."""
    valid = body(f'{{"state": "s", {Q}}}')
    chunk = lambda data: f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n"
    head = "POST /v1/systemone HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
    cases = [
        ("two different Content-Lengths", raw(head + f"Content-Length: {len(valid)}\r\nContent-Length: 3\r\n\r\n") + valid, {400}, False),
        ("Content-Length not a number", raw(head + "Content-Length: abc\r\n\r\n"), {400}, False),
        ("negative Content-Length", raw(head + "Content-Length: -5\r\n\r\n"), {400}, False),
        ("Content-Length with a plus sign", raw(head + f"Content-Length: +{len(valid)}\r\n\r\n") + valid, {400}, False),
        ("Content-Length and Transfer-Encoding both", raw(head + f"Content-Length: {len(valid)}\r\nTransfer-Encoding: chunked\r\n\r\n") + chunk(valid), {200, 400}, False),
        ("Transfer-Encoding: gzip, chunked", raw(head + "Transfer-Encoding: gzip, chunked\r\n\r\n") + chunk(valid), {501}, False),
        ("Transfer-Encoding: gzip alone", raw(head + "Transfer-Encoding: gzip\r\n\r\n") + valid, {400, 501}, False),
        ("chunked with a bad chunk size", raw(head + "Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"), {400}, False),
        ("chunked (valid)", raw(head + "Transfer-Encoding: chunked\r\n\r\n") + chunk(valid), {200}, False),
        ("a folded header line (obs-fold)", raw("GET /health HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n folded\r\n\r\n"), {400}, False),
        ("HTTP/2.0 request line", raw("GET /health HTTP/2.0\r\nHost: x\r\n\r\n"), {400, 505}, False),
        ("HTTP/0.9 request line", raw("GET /health\r\n\r\n"), {400}, False),
        ("HTTP/1.0 (valid)", raw("GET /health HTTP/1.0\r\n\r\n"), {200}, False),
        ("garbage instead of a request", raw(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64) + b"\r\n\r\n"), {400}, True),
        ("a bare line", raw("HELLO\r\n\r\n"), {400}, False),
        ("NUL in a header value", raw(b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n"), {400}, False),
        ("space before the colon", raw("GET /health HTTP/1.1\r\nHost: x\r\nX-A : b\r\n\r\n"), {400}, False),
        ("1 MiB header (431)", raw("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + "a" * (1 << 20) + "\r\n\r\n"), {431}, False),
        ("200 headers", raw("GET /health HTTP/1.1\r\nHost: x\r\n" + "".join(f"X-H{i}: {i}\r\n" for i in range(200)) + "\r\n"), {200, 431}, False),
        ("100 kB URI (414)", raw("GET /" + "a" * 100_000 + " HTTP/1.1\r\nHost: x\r\n\r\n"), {414}, False),
        ("absolute-form URI", raw("GET http://127.0.0.1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"), {200}, False),
        ("path traversal", raw("GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"), {400, 404}, False),
        ("unknown path", raw("GET /admin HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"), {404}, False),
        ("GET on the decide route", raw("GET /v1/systemone HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"), {405}, False),
        ("DELETE /health", raw("DELETE /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"), {405}, False),
        ("an invented method", raw("BREW /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"), {405}, False),
        ("lower-case method", raw("get /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"), {400, 405}, False),
        ("HEAD /health", raw("HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"), {200, 405}, False),
        ("Expect: 100-continue", raw(head + f"Expect: 100-continue\r\nContent-Length: {len(valid)}\r\n\r\n") + valid, {200}, False),
        ("an Authorization header without a key configured", post(valid, [("Authorization", "Bearer nonsense")]), {200}, False),
        ("a Content-Length longer than the body, then close", raw(head + "Content-Length: 1000\r\n\r\n") + valid, {400, 408}, True),
        ("half a header, then close", raw("POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Ty"), set(), True),
        ("the HTTP/2 preface", raw("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), set(), True),
        ("nothing at all", b"", set(), True),
    ]
    return [(f"protocol: {name}", request, statuses, may_close) for name, request, statuses, may_close in cases]


def exchange(host, port, request, timeout=30.0, half_close=False):
    """Sends `request` on a new connection and reads until the server closes it: (status, headers, body)
    or (None, {}, b"") when it closed without an answer."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        try:
            sock.sendall(request)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # The server answered and closed before reading it all.
        chunks = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not data:
                break
            chunks.append(data)
    reply = b"".join(chunks)
    if not reply:
        return None, {}, b""
    head, _, rest = reply.partition(b"\r\n\r\n")
    # Interim answers (100 Continue) come before the response.
    while head.startswith(b"HTTP/1.1 1") and rest.startswith(b"HTTP/"):
        head, _, rest = rest.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", ""):
        out, data = b"", rest
        while data:
            size_line, _, data = data.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out, data = out + data[:size], data[size + 2:]
        rest = out
    return status, headers, rest


def error_summary(status, headers, reply):
    """The error's type or loc, and what is wrong with its shape (None when it is the API's)."""
    try:
        parsed = json.loads(reply)
    except ValueError:
        return "", f"the body is not JSON: {reply[:80]!r}"
    if "x-typesafe-request-id" not in headers:
        return "", "no x-typesafe-request-id header"
    detail = parsed.get("detail") if isinstance(parsed, dict) else None
    if status == 422 and isinstance(detail, list) and detail and "loc" in detail[0]:
        return "loc=" + ".".join(str(p) for p in detail[0]["loc"]), None
    if isinstance(detail, dict) and detail.get("error_type") and detail.get("message"):
        return detail["error_type"], None
    return "", f"not the API's error shape: {reply[:120]!r}"


def commit():
    """The checkout's commit, when this runs in one (for the record)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def answer_bytes(reply):
    return reply.split(b',"x_latency_ms"')[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server on a loopback address (default: start one)")
    parser.add_argument("--prism", default="target/debug/prism", help="the prism binary to start")
    parser.add_argument("--serve-args", default="", help="more flags for prism serve")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds the whole run may take")
    parser.add_argument("--json-out", help="write the record here")
    args = parser.parse_args()

    server = None
    if args.url:
        url = urllib.parse.urlparse(args.url)
        host, port = url.hostname or "", url.port or 80
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            sys.exit(f"{host}: this script only talks to a loopback address")
        host = "127.0.0.1" if host == "localhost" else host
    else:
        server = subprocess.Popen(
            [args.prism, "serve", "--port", "0", "--header-timeout", "5", *args.serve_args.split()],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        host, port = "127.0.0.1", None
        started = time.monotonic()
        while port is None and time.monotonic() - started < 120:
            line = server.stdout.readline()
            if not line and server.poll() is not None:
                sys.exit("prism serve exited before Ready")
            if line.startswith("Ready on http://"):
                port = int(line.split()[2].rsplit(":", 1)[1])
        if port is None:
            server.kill()
            sys.exit("prism serve printed no Ready line within 120 s")

    started = time.monotonic()
    results, failures = [], 0
    try:
        status, _, reference = exchange(host, port, post(REFERENCE))
        if status != 200:
            sys.exit(f"the reference request got {status}")
        reference = answer_bytes(reference)

        def healthy():
            status, _, reply = exchange(host, port, raw("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
            again, _, answer = exchange(host, port, post(REFERENCE))
            return status == 200 and again == 200 and answer_bytes(answer) == reference

        cases = json_cases() + body_cases() + protocol_cases()
        for index, (name, request, statuses, may_close) in enumerate(cases, 1):
            if time.monotonic() - started > args.deadline:
                print(f"stopped at the {args.deadline:.0f} s deadline", flush=True)
                failures += 1
                break
            t0 = time.monotonic()
            try:
                # A case that may end without an answer also closes its sending side.
                status, headers, reply = exchange(host, port, request, half_close=may_close)
                problem = None
            except OSError as error:
                status, headers, reply, problem = None, {}, b"", f"transport error: {error}"
            took = time.monotonic() - t0
            what = ""
            if problem is None:
                if status is None:
                    problem = None if may_close else "closed without an answer"
                elif status not in statuses:
                    problem = f"status {status}, expected one of {sorted(statuses)}"
                if status is not None and status >= 400:
                    what, shape = error_summary(status, headers, reply)
                    problem = problem or shape
            ok = problem is None
            failures += 0 if ok else 1
            results.append({"name": name, "status": status, "error": what, "seconds": round(took, 3),
                            "ok": ok, "problem": problem})
            print(f"{'ok  ' if ok else 'FAIL'} {index:3d} {status if status is not None else '-':>3} "
                  f"{took:6.2f}s  {name}  {what}{'  -- ' + problem if problem else ''}", flush=True)
            if index % 10 == 0 and not healthy():
                print(f"FAIL the server is not healthy after request {index}", flush=True)
                failures += 1
        final_health = healthy()
        if not final_health:
            failures += 1
        _, _, stats = exchange(host, port, raw("GET /stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
        stats = json.loads(stats)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    record = {
        "requests": len(results),
        "failures": failures,
        "healthy_at_end": final_health,
        "seconds": round(time.monotonic() - started, 1),
        "serve_args": args.serve_args,
        "commit": commit(),
        "statuses": dict(sorted(collections.Counter(
            "no answer" if r["status"] is None else str(r["status"]) for r in results).items())),
        "stats_requests": stats.get("requests"),
        "results": results,
    }
    print(f"{len(results)} hostile requests, {failures} failures, healthy at the end: {final_health}, "
          f"{record['seconds']} s", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump(record, out, indent=1)
            out.write("\n")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
