"""Serving benchmark against a running ``omnistage serve`` (same as ``omnistage bench``).

    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --concurrency 4 --num-requests 16 --audio
"""

from omnistage.entrypoints.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
