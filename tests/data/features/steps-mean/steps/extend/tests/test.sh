#!/bin/sh
if [ "$(cat notes.txt 2>/dev/null)" = "$(printf 'one\ntwo')" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
