#!/bin/bash
# bash's /dev/tcp: the image has no HTTP client; `web` resolves through /etc/hosts
exec 3<>/dev/tcp/web/8080
printf 'GET / HTTP/1.0\r\nHost: web\r\n\r\n' >&3
sed '1,/^\r$/d' <&3 > /app/page.txt
