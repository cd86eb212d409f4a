/*
 * utils/serdes/serdes.h - where NIXL's install puts nixlSerDes (programs include <utils/serdes/serdes.h>); the
 * class itself is gixl's serdes/serdes.h. Written for gixl.
 */
#ifndef GIXL_UTILS_SERDES_H
#define GIXL_UTILS_SERDES_H

#include "../../serdes/serdes.h"

#endif
