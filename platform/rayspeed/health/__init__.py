"""rayspeed.health"""
