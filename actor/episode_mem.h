// episode_mem.h: the actor's memory account of episodes in flight, and its write-back pool.
//
// An episode in flight holds a decode state on the model's device (model/model.h): the
// KDA state of every head of every KDA layer (H x D x D each) and the three short-conv windows
// ((W-1) x H*D each) of every KDA layer, whatever its length, and the MLA latents (dc + dr per
// token and MLA layer, at the backend's latent element size), which grow with it. Sized at
// [actor] max_tokens for every slot, a 1M-token budget holds few episodes; most of them are
// far shorter most of the time, and many wait for a tool rather than decode.
//
// The account (with [actor] device_budget_mb > 0):
//   * charges each episode the device bytes of its state as allocated
//     (mtrl_decode_state_bytes of its capacity), and never lets the sum pass the budget;
//   * grows a state on demand (mtrl_epmem_reserve: capacity doubled, or just what is needed
//     when doubling does not fit, never past max_tokens), so an episode pays for its length;
//   * refuses a new episode (mtrl_epmem_admit) when its first state does not fit: the caller
//     keeps it waiting, it does not start and then fail;
//   * at the budget, moves the decode states of idle episodes (the caller says which: waiting on
//     a tool, or on the prefill of an env's text) to host memory, least recently used first
//     (mtrl_epmem_park), and back when they have work (mtrl_epmem_unpark), within [actor]
//     host_budget_mb; a state that comes back is the same bits (download and upload are exact:
//     model.h), so the episode continues with the tokens it would have produced;
//   * only when even that cannot make room does a growth fail, and the caller ends that
//     episode `truncated` with the reason mtrl_epmem_reserve wrote.
// Slot i's decode state is the caller's struct (states[i], borrowed at init); the account
// allocates, grows, frees and parks what it points to. One thread; no locks.
#ifndef MTRL_ACTOR_EPISODE_MEM_H
#define MTRL_ACTOR_EPISODE_MEM_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"
#include "common/status.h"

// The decode-state sizes of a model, by part (device bytes).
typedef struct mtrl_epmem_sizes {
    size_t kda_state_per_head;  // D x D reals: one head's state of one KDA layer
    size_t kda_state;           // every head of every KDA layer
    size_t conv;                // the conv windows of every KDA layer
    size_t latent_per_token;    // one token's MLA latents over every MLA layer
    int n_kda, n_mla, heads;
} mtrl_epmem_sizes;

void mtrl_epmem_sizes_of(const mtrl_model *m, mtrl_epmem_sizes *out);

typedef enum mtrl_epmem_where {
    MTRL_EPMEM_NONE = 0,   // no episode (no state allocated)
    MTRL_EPMEM_DEVICE = 1, // its state is on the device
    MTRL_EPMEM_HOST = 2,   // parked: its state is in host memory, the device copy freed
} mtrl_epmem_where;

typedef struct mtrl_epmem_slot {
    mtrl_epmem_where where;
    int cap;              // capacity of the state (device, or the one it returns with)
    int pos;              // positions of a parked state
    size_t device_bytes;  // charged to the device budget (0 when parked or none)
    size_t host_bytes;    // charged to the host budget (parked)
    real *hS, *hC, *hL;   // the parked state's host arrays (mtrl_decode_state_download layout)
    uint64_t last_use;    // account clock at its last reserve/admit/unpark (LRU)
} mtrl_epmem_slot;

typedef struct mtrl_epmem {
    mtrl_model *m;
    mtrl_decode_state **states; // [n] borrowed
    mtrl_epmem_slot *slot;      // [n]
    int n, max_tokens;
    size_t device_budget, host_budget;
    size_t device_used, host_used, device_peak, host_peak;
    uint64_t clock;
    uint64_t parks, unparks, refusals, grows; // counters (for logs and tests)
} mtrl_epmem;

// An account of n slots whose states are states[0..n) (zeroed, unallocated), capacities up to
// max_tokens. host_budget 0: nothing is parked. MTRL_ERR_USAGE when the budget cannot hold one
// state of min_cap tokens (the message has the numbers).
mtrl_status mtrl_epmem_init(mtrl_epmem *a, mtrl_model *m, mtrl_decode_state **states, int n, int max_tokens,
                            size_t device_budget, size_t host_budget, int min_cap, mtrl_error *err);
void mtrl_epmem_free(mtrl_epmem *a); // frees every state it allocated, parked ones too

// A new episode in slot i (which must hold none) with a state of cap tokens (reset, pos 0).
// idle (nullable, [n]): the slots that may be parked to make room. MTRL_OK, or MTRL_ERR_NOMEM
// when it does not fit even so (nothing changed but parks).
mtrl_status mtrl_epmem_admit(mtrl_epmem *a, int i, int cap, const uint8_t *idle, mtrl_error *err);
// Slot i's episode ended: its state (device or host) is freed.
void mtrl_epmem_release(mtrl_epmem *a, int i);
// Slot i's state (on the device) holds at least need positions, grown if it must be; idle as
// for admit (slot i itself is never parked). MTRL_OK, or MTRL_ERR_NOMEM with the reason for the
// episode's `truncated` ("the actor's device budget of 512 MiB is full: ..."), or
// MTRL_ERR_LIMIT when need is over max_tokens.
mtrl_status mtrl_epmem_reserve(mtrl_epmem *a, int i, int need, const uint8_t *idle, mtrl_error *err);
// Moves slot i's state to the host (it must be on the device). MTRL_ERR_NOMEM when the host
// budget cannot take it.
mtrl_status mtrl_epmem_park(mtrl_epmem *a, int i, mtrl_error *err);
// Brings slot i's parked state back (a no-op when on the device) with room for need positions
// (0: its old capacity), parking idle others if the device budget needs it. MTRL_ERR_NOMEM when
// it cannot come back now (it stays parked).
mtrl_status mtrl_epmem_unpark(mtrl_epmem *a, int i, int need, const uint8_t *idle, mtrl_error *err);

// 1 when slot i could hold need positions on the device if every idle slot (i excepted) were
// parked: what decides whether an episode waits (its state parked until busy ones end) or goes
// ahead. Counts the moment of a growth, when the old and the new state both exist.
int mtrl_epmem_fits(const mtrl_epmem *a, int i, int need, const uint8_t *idle);
// 1 when a state of need positions fits the budget with nothing else on the device.
int mtrl_epmem_fits_alone(const mtrl_epmem *a, int need);
// Positions of slot i's state, on the device or parked.
int mtrl_epmem_pos(const mtrl_epmem *a, int i);
// Slots other than i whose states are on the device.
int mtrl_epmem_others_on_device(const mtrl_epmem *a, int i);

static inline int mtrl_epmem_parked(const mtrl_epmem *a, int i) { return a->slot[i].where == MTRL_EPMEM_HOST; }

#endif
