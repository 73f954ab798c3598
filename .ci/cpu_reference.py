"""How fast this machine's CPU runs today, printed beside CI's wall time.

The suite's wall time is mostly CPU (each of its few hundred processes spends seconds
importing torch and transformers), and the shared CI machine's speed moves by up to
1.8x within a day. A fixed pure-Python loop timed in CPU seconds, printed before and
after the suite, makes two runs' wall times comparable (benchmarks/RESULTS.md quotes
it). Standard library only: it runs before the venv exists."""

import json
import time

STEPS = 20_000_000

if __name__ == "__main__":
    # At module scope (global name lookups), as the figures in benchmarks/RESULTS.md were taken.
    started = time.process_time()
    total = 0
    for step in range(STEPS):
        total += step
    print(
        json.dumps(
            {
                "cpu_reference_loop_s": round(time.process_time() - started, 2),
                "steps": STEPS,
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )
    )
