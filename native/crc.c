/*
 * crc.c -- CRC-32C (Castagnoli), the block checksum: the SSE4.2 instruction
 * where the CPU has it (cpu.c's detection, the one path every feature takes,
 * TRACT_NO_SSE42 included), else bit by bit (layout.c's reflected CRC).
 */
#include <string.h>

#include "internal.h"

#if defined(__x86_64__)
/* CRC-32C with the crc32 instruction, 8 bytes at a time (internal) */
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(const uint8_t *p, uint64_t n)
{
	uint64_t c = 0xFFFFFFFFu;
	for (; n >= 8; n -= 8, p += 8) {
		uint64_t v;
		memcpy(&v, p, 8);
		c = __builtin_ia32_crc32di(c, v);
	}
	uint32_t c32 = (uint32_t)c;
	for (; n; n--, p++)
		c32 = __builtin_ia32_crc32qi(c32, *p);
	return c32 ^ 0xFFFFFFFFu;
}
#endif

/* CRC-32C (Castagnoli) of len bytes, as used for block checksums. */
uint32_t tract_crc32c(const void *buf, uint64_t len)
{
#if defined(__x86_64__)
	if (tract_cpu_features() & TRACT_CPU_SSE42)
		return crc32c_hw(buf, len);
#endif
	return tract_crc_bitwise(0x82F63B78u, buf, len);   /* no SSE4.2: slow but right */
}
