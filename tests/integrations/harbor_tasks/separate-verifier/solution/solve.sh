#!/bin/bash
python3 -c "print(sum(int(x) for x in open('/app/numbers.txt')))" > /app/answer.txt
# left behind in the agent's sandbox: a separate verifier must not see it
touch /app/agent-only-scratch
