#!/bin/bash
echo "withdraw 2" >> "$LEDGER"
