#!/bin/bash
got=$(psql -h db -U postgres -At -c "SELECT v FROM answers" 2>/dev/null)
if [ "$got" = 42 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
