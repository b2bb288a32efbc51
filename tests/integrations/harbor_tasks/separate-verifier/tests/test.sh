#!/bin/bash
mkdir -p /logs/verifier
# a fresh sandbox: the artifact arrived, the agent's scratch file did not
if [ -e /app/agent-only-scratch ]; then echo 0 > /logs/verifier/reward.txt; exit 0; fi
if [ "$(cat /app/answer.txt 2>/dev/null)" = "42" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
