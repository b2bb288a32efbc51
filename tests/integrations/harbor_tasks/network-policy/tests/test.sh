#!/bin/bash
mkdir -p /logs/verifier
reward=1
# the agent phase had no network at all
[ "$(cat /app/agent-net.txt 2>/dev/null)" = "unreachable" ] || reward=0
# the verifier phase: the allowed host answers, any other is refused
[ "$(curl -sS --fail --max-time 30 @OUTSIDE_URL@)" = "hello from outside" ] || reward=0
if curl -sS -o /dev/null --max-time 20 https://pypi.org/simple/; then reward=0; fi
echo $reward > /logs/verifier/reward.txt
