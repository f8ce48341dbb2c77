#!/usr/bin/env python3
"""Reduces a `mooncake_interop.py --record` file to the fixture iris's replay test reads.

    python3 tools/epd-interop/replay_fixture.py RECORD ec/tests/fixtures/mooncake/replay.json

Kept: the versions, the consumer's handshake reply frame (hex), every control exchange iris
(the producer) had with vLLM's consumer in order (the consumer's own scheduler traffic is
dropped), and each pushed item's identifier, transfer id, shape, dtype and rows (hex, deduplicated
by identifier). Dropped: the images, the HTTP exchanges and the decode side. Standard library only.
"""

import json
import sys


def main() -> int:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    record = json.load(open(sys.argv[1]))
    rows = {}
    for item in record["items"]:
        known = rows.setdefault(item["mm_hash"], item["rows_hex"])
        if known != item["rows_hex"]:
            sys.exit(f"two different rows recorded for {item['mm_hash']}")
    fixture = {
        "made_by": "tools/epd-interop/mooncake_interop.py --record, reduced by replay_fixture.py",
        "vllm": record["vllm"],
        "mooncake": record["mooncake"],
        "handshake": {
            "session": record["handshake"]["session"],
            "reply_frame_hex": record["handshake"]["reply_frame_hex"],
        },
        "control": [
            {"request": c["request"], "reply": c["reply"]}
            for c in record["control"]
            if c["origin"] == "producer"
        ],
        "rows_hex": rows,
    }
    with open(sys.argv[2], "w") as out:
        json.dump(fixture, out, indent=1, sort_keys=True)
        out.write("\n")
    print(f"{sys.argv[2]}: {len(fixture['control'])} exchanges, {len(rows)} items")
    return 0


if __name__ == "__main__":
    sys.exit(main())
