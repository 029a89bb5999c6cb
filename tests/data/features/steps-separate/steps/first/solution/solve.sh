#!/bin/sh
echo alpha > /srv/out.txt
echo hidden > /srv/undeclared.txt
