#!/bin/bash
mkdir -p /logs/verifier
expected=$'opening balance 0\ndeposit 5\nwithdraw 2'
if [ "$(cat /app/ledger.txt)" = "$expected" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
