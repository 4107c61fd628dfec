#!/usr/bin/env python3
"""Soak test of `prism serve`: many clients for a long time, some hostile, some leaving mid-request.

Loopback only, bounded in time and count. Starts `prism serve` itself (the bundled demo model unless
--serve-args says otherwise), sends each valid request of its pool once alone to learn its answer, then
runs CLIENTS threads for DURATION seconds. Each request is, at random:
- valid (from the pool): its answer must be byte-identical (before `x_latency_ms`) to the alone answer, or
  a designed refusal under load (503 queue full, 504 past `--timeout`), counted apart;
- hostile (10 %): a malformed or unanswerable body; it must get a 4xx with a JSON error body (or a
  designed 503/504);
- abandoned (5 %): a valid request whose client closes the connection before reading the answer.
Every 5 s it samples the server's RSS from /proc. At the end it prints (and writes with --json-out) the
counts, the statuses, lost answers (a valid request answered with other bytes, with a status other than 200
or the designed 503/504, or not at all), 5xx other than the designed 503/504, and the RSS growth after
warm-up (median of the first three samples after it against the median of the last three). Exit status 1
when any of those checks fails.
"""

import argparse
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time


def valid_pool(n, seed):
    rng = random.Random(seed)
    words = "the customer parcel arrived late box crushed invoice charged twice refund order delivery " \
            "driver account password login error payment card declined cancel renewal price".split()
    pool = []
    for i in range(n):
        text = f"Ticket {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(20, 400)))
        questions = {}
        for q in range(rng.randint(1, 4)):
            kind = rng.choice(["noul", "choice", "score", "wide"])
            if kind == "noul":
                questions[f"q{q}"] = {"type": "noul", "instructions": f"Does it mention {rng.choice(words)}?"}
            elif kind == "choice":
                questions[f"q{q}"] = {"type": "choice", "instructions": "Which team?",
                                      "criteria": {"billing": None, "shipping": "Parcels", "tech": None}}
            elif kind == "score":
                questions[f"q{q}"] = {"type": "score", "instructions": "How upset?",
                                      "criteria": ["calm", "annoyed", "angry"]}
            else:
                questions[f"q{q}"] = {"type": "choice", "instructions": "Which queue?",
                                      "criteria": [f"queue_{k}" for k in range(30)]}
        pool.append(json.dumps({"state": text, "questions": questions}).encode())
    return pool


HOSTILE = [
    b'{"state": "s", "questions": {',
    b'',
    b'[1, 2, 3]',
    b'{"state": "s"}',
    b'{"state": "s", "questions": {"q": {"type": "choice", "instructions": "x", "criteria": ["only", "only"]}}}',
    b'{"state": "s", "questions": {"q": {"type": "score", "instructions": "x", "criteria": [0,1,2,3,4,5,6,7,8,9,10]}}}',
    b'{"state": "s", "questions": {"q": {"type": "box", "instructions": "x"}}}',
    b'{"state": "s", "questions": {"q": {"type": "choice", "instructions": "   ", "criteria": ["a", "b"]}}}',
    b'{"state": "s", "questions": {"q": {"type": "noul", "instructions": "x"}}, "gate": 7}',
    b'{"state": "s", "questions": {"q": {"type": "noul", "instructions": "x"}}, "think_mode": "always"}',
    b'{"state": "\\ud800", "questions": {"q": {"type": "noul", "instructions": "x"}}}',
    b'{"state": "s", "questions": {"q": {"type": "noul", "instructions": "x"}}, "return_details": "yes"}',
    b'\xff\xfe\x00garbage',
    b'{"state": "s", "questions": {"q": {"type": "noul", "instructions": "x"}}, "images": ["!!!"]}',
]


def rss_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def answer_bytes(body):
    marker = b',"x_latency_ms"'
    i = body.find(marker)
    return body if i < 0 else body[:i]


def post(host, port, body, timeout=120):
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/systemone", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def abandon(host, port, body):
    """Sends a whole request and closes the connection without reading the answer."""
    with socket.create_connection((host, port), timeout=10) as s:
        head = (f"POST /v1/systemone HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        s.sendall(head + body)
        time.sleep(random.uniform(0.0, 0.05))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prism", default="target/release/prism", help="the prism binary")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=120.0,
                        help="seconds before the RSS baseline (the prefix cache fills meanwhile)")
    parser.add_argument("--pool", type=int, default=48, help="distinct valid requests")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--serve-args", default="", help="extra arguments for prism serve")
    parser.add_argument("--json-out", help="write the report here")
    args = parser.parse_args()
    if args.duration > 3600 or args.clients > 512:
        sys.exit("soak: at most 3600 s and 512 clients")

    server = subprocess.Popen([args.prism, "serve", "--port", "0", *args.serve_args.split()],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = None
        deadline = time.time() + 120
        while time.time() < deadline:
            line = server.stdout.readline()
            m = re.search(r"Ready on http://([\d.]+):(\d+)", line or "")
            if m:
                host, port = m.group(1), int(m.group(2))
                break
            if not line and server.poll() is not None:
                sys.exit("soak: prism serve exited before Ready")
        if port is None:
            sys.exit("soak: prism serve was not Ready within 120 s")
        threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()

        pool = valid_pool(args.pool, args.seed)
        expected = []
        for body in pool:
            status, reply = post(host, port, body)
            if status != 200:
                sys.exit(f"soak: a pool request alone got {status}: {reply[:200]!r}")
            expected.append(answer_bytes(reply))

        lock = threading.Lock()
        counts = {"valid": 0, "hostile": 0, "abandoned": 0, "lost": 0, "bad_hostile": 0, "unexpected_5xx": 0,
                  "refused_under_load": 0, "transport_errors": 0}
        statuses = {}
        examples = []
        stop = time.time() + args.duration

        def client(c):
            rng = random.Random(args.seed * 1000 + c)
            while time.time() < stop:
                roll = rng.random()
                try:
                    if roll < 0.10:
                        body = rng.choice(HOSTILE)
                        status, reply = post(host, port, body)
                        ok = (400 <= status < 500 or status in (503, 504)) and reply[:1] == b"{"
                        with lock:
                            counts["hostile"] += 1
                            if status in (503, 504):
                                counts["refused_under_load"] += 1
                            statuses[status] = statuses.get(status, 0) + 1
                            if not ok:
                                counts["bad_hostile"] += 1
                                if len(examples) < 5:
                                    examples.append({"hostile": body[:80].decode("latin-1"), "status": status,
                                                     "reply": reply[:200].decode("latin-1")})
                            if status >= 500 and status not in (503, 504):
                                counts["unexpected_5xx"] += 1
                    elif roll < 0.15:
                        abandon(host, port, rng.choice(pool))
                        with lock:
                            counts["abandoned"] += 1
                    else:
                        i = rng.randrange(len(pool))
                        status, reply = post(host, port, pool[i])
                        with lock:
                            counts["valid"] += 1
                            statuses[status] = statuses.get(status, 0) + 1
                            if status >= 500 and status not in (503, 504):
                                counts["unexpected_5xx"] += 1
                            if status in (503, 504):
                                counts["refused_under_load"] += 1
                            elif status != 200 or answer_bytes(reply) != expected[i]:
                                counts["lost"] += 1
                                if len(examples) < 5:
                                    examples.append({"valid": i, "status": status,
                                                     "reply": reply[:300].decode("utf-8", "replace")})
                except (OSError, http.client.HTTPException) as e:
                    with lock:
                        counts["transport_errors"] += 1
                        if len(examples) < 5:
                            examples.append({"transport": repr(e)})

        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)]
        started = time.time()
        for t in threads:
            t.start()
        samples = []
        while time.time() < stop:
            time.sleep(5)
            samples.append((round(time.time() - started, 1), rss_kb(server.pid)))
            with lock:
                print(f"\r  {samples[-1][0]:6.0f} s  rss {samples[-1][1]} kB  {counts}", end="", file=sys.stderr)
        for t in threads:
            t.join(timeout=180)
        print(file=sys.stderr)
        base = [kb for s, kb in samples if s >= args.warmup and kb]
        if len(base) >= 6:
            first, last = sorted(base[:3])[1], sorted(base[-3:])[1]
            growth = (last - first) / first
        else:
            growth = None
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/stats")
        stats = json.loads(conn.getresponse().read())
        conn.close()
        report = {
            "clients": args.clients, "duration_s": args.duration, "warmup_s": args.warmup, "pool": len(pool),
            "serve_args": args.serve_args, "counts": counts,
            "statuses": {str(k): v for k, v in sorted(statuses.items())}, "examples": examples,
            "rss_kb": samples, "rss_growth_after_warmup": growth,
            "server_engine": stats.get("engine"), "server_prefix_cache": stats.get("prefix_cache"),
            "checks": {
                "no_lost_answers": counts["lost"] == 0,
                "no_unexpected_5xx": counts["unexpected_5xx"] == 0,
                "hostile_all_4xx": counts["bad_hostile"] == 0,
                "rss_growth_below_5_percent": growth is not None and growth < 0.05,
                "server_alive": server.poll() is None,
            },
        }
        print(json.dumps(report, indent=1))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(report, f, indent=1)
        sys.exit(0 if all(report["checks"].values()) else 1)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
