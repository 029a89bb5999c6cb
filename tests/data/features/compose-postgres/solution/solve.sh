#!/bin/bash
psql -h db -U postgres -v ON_ERROR_STOP=1 -c "CREATE TABLE answers (v integer); INSERT INTO answers VALUES (42);"
