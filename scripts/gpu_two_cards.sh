#!/usr/bin/env bash
# On a machine with two GPUs (the device tool's nvidia-h200-x2 kind): everything docs/MULTI_GPU.md's
# two-card tables need, as steps of gpu_session.sh (see there). Too long for one device call: run it
# in parts, for example STEPS="tests gen topo x2" and then STEPS="gen x2long x2sweep x2served".
exec env STEPS="${STEPS:-tests gen topo x2 x2long x2sweep x2served}" bash "$(dirname "$0")/gpu_session.sh"
