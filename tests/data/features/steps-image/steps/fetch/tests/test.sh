#!/bin/sh
if grep -qx alpha out.txt 2>/dev/null && grep -qx set prepared.txt; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
