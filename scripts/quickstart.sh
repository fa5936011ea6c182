#!/usr/bin/env bash
# The README's first quickstart command: brings up the whole system on loopback (etcd, two
# workers, the gateway with its placement controller), declares the example models and sends
# real inferences through the gateway. See deploy/local/up.sh for the knobs.
set -euo pipefail
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/deploy/local/up.sh" "$@"
