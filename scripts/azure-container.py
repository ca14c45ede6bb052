#!/usr/bin/env python3
"""Create a blob container on Azurite (SharedKey-signed; Azurite refuses anonymous PUTs).

usage: azure-container.py ENDPOINT CONTAINER
ENDPOINT is the blob service, e.g. http://127.0.0.1:10000 (account devstoreaccount1).
Exit 0 when the container exists afterwards (created now or before).
"""
import base64
import hashlib
import hmac
import sys
import urllib.error
import urllib.request
from email.utils import formatdate

ACCOUNT = "devstoreaccount1"
# Azurite's documented, well-known development key (not a secret).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
VERSION = "2021-08-06"


def main() -> int:
    endpoint, container = sys.argv[1].rstrip("/"), sys.argv[2]
    date = formatdate(usegmt=True)
    to_sign = (
        "PUT\n" + "\n" * 11
        + f"x-ms-date:{date}\nx-ms-version:{VERSION}\n"
        + f"/{ACCOUNT}/{ACCOUNT}/{container}\nrestype:container"
    )
    signature = base64.b64encode(
        hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest()
    ).decode()
    request = urllib.request.Request(
        f"{endpoint}/{ACCOUNT}/{container}?restype=container",
        method="PUT",
        headers={
            "x-ms-date": date,
            "x-ms-version": VERSION,
            "Authorization": f"SharedKey {ACCOUNT}:{signature}",
            "Content-Length": "0",
        },
    )
    try:
        urllib.request.urlopen(request, timeout=10)
    except urllib.error.HTTPError as e:
        if e.code != 409:  # 409: the container already exists
            print(f"creating container {container} on {endpoint} failed: {e.code} {e.read()[:300]!r}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
