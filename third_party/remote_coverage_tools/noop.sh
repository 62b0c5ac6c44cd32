#!/bin/sh
# No-op coverage tool (offline shim).
exit 0
