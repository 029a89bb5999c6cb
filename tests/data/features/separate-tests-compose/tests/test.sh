#!/bin/sh
# never run: the verifier's image holds its own /tests/test.sh
echo 0.5 > /logs/verifier/reward.txt
