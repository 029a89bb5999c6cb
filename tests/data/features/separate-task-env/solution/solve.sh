#!/bin/sh
echo declared > /srv/out.txt
echo hidden > /srv/undeclared.txt
