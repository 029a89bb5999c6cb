#!/bin/bash
# the greeter may still be starting: try for up to 20 s
for _ in $(seq 100); do
    if exec 3<>/dev/tcp/localhost/${GREETER_PORT:?}; then
        printf 'GET / HTTP/1.0\r\n\r\n' >&3
        sed '1,/^\r$/d' <&3 > /app/greeting.txt
        [ -s /app/greeting.txt ] && exit 0
    fi 2>/dev/null
    sleep 0.2
done
exit 1
