#!/bin/sh
echo hello > /tmp/greeting
