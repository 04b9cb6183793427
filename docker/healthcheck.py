"""Container health check: exit 0 when GET /health answers 200, 1 otherwise (503 while loading, no answer).

Used by the image's HEALTHCHECK and by compose.yaml; standard library only, so the image needs no curl.
The port is DSV4SERVE_PORT (default 8000), the one the server itself reads.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    url = f"http://127.0.0.1:{os.environ.get('DSV4SERVE_PORT') or '8000'}/health"
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:  # HTTPError (503 while loading) is a URLError
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
