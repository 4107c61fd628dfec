#!/usr/bin/env python3
"""Write an N-item `prism eval` suite generated from examples/suites/sample.jsonl (issue #23's device run).

Usage: python3 tools/device/make_suite.py N OUT.jsonl

Item i is sample item i mod 32 (its questions and labels unchanged) with its evidence made distinct and of
varied length: a case number first, then 0-11 context sentences drawn from a fixed pool by a seeded RNG
(about 20-300 tokens of evidence), so no two items share a prompt and the prefix cache cannot answer one
from another. The same N always gives the same file (seed 23). The labels keep their meaning for the
sample's own items only; on the synthetic model (random weights) the accuracy is meaningless and the run
measures agreement between precisions, drift and items per second.
"""

import json
import random
import sys
from pathlib import Path

CONTEXT = [
    "The customer has been with us for three years.",
    "This is the second message about the same order.",
    "They wrote from the mobile app.",
    "An earlier reply from support promised a call back.",
    "The account is on the family plan.",
    "The order number was included in the message.",
    "They attached two photos.",
    "The message arrived outside business hours.",
    "The customer asked for a written confirmation.",
    "A colleague already tagged this conversation.",
    "The delivery address is in another country.",
    "They mentioned a deadline at the end of the week.",
    "Payment was made with a gift card.",
    "The last survey from this customer was positive.",
    "The message was forwarded by the sales team.",
    "They use the desktop version of the product.",
]


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    n, out = int(sys.argv[1]), Path(sys.argv[2])
    root = Path(__file__).resolve().parents[2]
    base = [json.loads(line) for line in open(root / "examples/suites/sample.jsonl") if line.strip()]
    rng = random.Random(23)
    with open(out, "w") as f:
        for i in range(n):
            item = json.loads(json.dumps(base[i % len(base)]))
            extra = " ".join(rng.sample(CONTEXT, rng.randint(0, 11)))
            state = item["request"]["state"]
            prefix = f"Case {10000 + i}."
            if isinstance(state, str):
                item["request"]["state"] = " ".join(s for s in (prefix, state, extra) if s)
            else:
                item["request"]["state"] = {"case": prefix, **state, "context": extra}
            item["id"] = f"{item['id']}-{i:05d}"
            item["tags"] = list(item.get("tags", [])) + ["generated"]
            f.write(json.dumps(item) + "\n")


if __name__ == "__main__":
    main()
