"""The profile step's verdict: `iris profile --json` dry and real on the same model and device.

The dry run must report the arena the real step takes, exactly, and the arena must be within 5%
of the most bytes the step's tensors hold live at once. Each file is the command's whole output:
progress lines on standard error may come before the JSON report.

    python profile_verdict.py DRY.json REAL.json
"""

import json
import sys


def report(path):
    text = open(path).read()
    start = 0 if text.startswith("{") else text.index("\n{") + 1
    return json.JSONDecoder().raw_decode(text[start:])[0]


def main():
    dry, real = report(sys.argv[1]), report(sys.argv[2])
    arena, live = dry["peak_activation_bytes"], dry["planned_peak_activation_bytes"]
    print(
        f"dry arena {arena}, real arena {real['peak_activation_bytes']}, live peak {live} "
        f"({arena / max(live, 1):.4f}x), step outputs {dry['step_outputs_bytes']}"
    )
    same = arena == real["peak_activation_bytes"]
    near = live <= arena <= 1.05 * live
    if not same:
        print("the dry run's arena differs from the real step's")
    if not near:
        print("the arena is not within 5% of the live peak")
    print("verdict:", "pass" if same and near else "fail")
    return 0 if same and near else 1


if __name__ == "__main__":
    sys.exit(main())
