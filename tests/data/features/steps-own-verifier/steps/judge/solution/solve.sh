#!/bin/sh
echo beta >> /srv/out.txt
