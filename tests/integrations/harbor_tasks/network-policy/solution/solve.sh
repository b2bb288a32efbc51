#!/bin/bash
if curl -sS -o /dev/null --fail --max-time 20 @OUTSIDE_URL@; then echo reachable; else echo unreachable; fi > /app/agent-net.txt
