"""Summary of a `llmdiff kernels --check --json` file (the device scripts' first lines).

    python3 check_summary.py CHECK_JSON [LABEL:SUBSTR[|SUBSTR...] ...]

Prints how many checks pass and the first 20 failing cases, then for each LABEL the cases whose
name holds one of its SUBSTRs: how many, how many pass, the worst rel_l2 and any failures.
"""
import json
import sys

try:
    checks = json.load(open(sys.argv[1]))["checks"]
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"no kernel check results in {sys.argv[1]} ({e})")
print(sum(x["pass"] for x in checks), "of", len(checks), "kernel checks pass; failing:",
      [x["case"] for x in checks if not x["pass"]][:20])
for spec in sys.argv[2:]:
    label, subs = spec.split(":", 1)
    cls = [x for x in checks if any(s in x["case"] for s in subs.split("|"))]
    finite = [x for x in cls if x["rel_l2"] is not None]
    worst = max(finite, key=lambda x: x["rel_l2"], default=None)
    print(f"{label} cases: {len(cls)}, {sum(x['pass'] for x in cls)} pass; max rel_l2",
          f"{worst['rel_l2']:.3e} in {worst['case']}" if worst else None)
    for x in cls:
        if not x["pass"]:
            print("  FAIL", x["case"], x["rel_l2"])
