#!/bin/bash
echo "deposit 5" >> "$LEDGER"
